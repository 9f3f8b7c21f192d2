"""``metrics.jsonl``: one line of statistics per PPO update, in step order, each step once."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["MetricsLog"]


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)

    def append(self, records: list[dict]) -> None:
        with open(self.path, "a") as fh:
            fh.writelines(json.dumps(record) + "\n" for record in records)

    def last_step(self) -> int:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        return json.loads(lines[-1])["step"] if lines else 0

    def restore(self, records: list[dict]) -> list[dict]:
        """Append those of ``records`` past the file's last step (lines a crash kept from being written); returns
        them."""
        last = self.last_step()
        missing = [record for record in records if record["step"] > last]
        self.append(missing)
        return missing
