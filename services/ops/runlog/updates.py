"""The learner's ``metrics.jsonl`` as the log tools read it: each update's line names its groups (``groups``)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["trained_in", "update_lines"]


def trained_in(run_dir: Path | None) -> dict[str, int]:
    """Group key (``<step>/<row>``) → the update (policy version it made) that trained it; empty without a run
    directory or its metrics."""
    if run_dir is None:
        return {}
    return {group: record["step"] for record in update_lines(run_dir) for group in record.get("groups", ())}


def update_lines(run_dir: Path) -> list[dict]:
    """The learner's metrics lines (one per update, in order) of ``run_dir``; empty without them."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
