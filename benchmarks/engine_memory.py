"""The vLLM engine's memory over a long streaming run: ``streamppo run`` (embedded, vowels example, vLLM generator,
``generation.streaming``) for ``steps`` updates, the resident memory of the engine's processes (its core and
workers: the run's child processes) read every few seconds against the updates made so far.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "vowels" / "config.yaml"


def engine_memory(steps: int = 600, settings: tuple[str, ...] = (), every_s: float = 5.0) -> dict:
    import psutil

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        overrides = [
            f"run.dir={run_dir}",
            f"run.steps={steps}",
            f"run.run_id=mem{uuid.uuid4().hex[:6]}",
            "generation.backend=vllm",
            "generation.streaming=true",
            "data.eval_prompts=0",
            *settings,
        ]
        command = [sys.executable, "-m", "services.cli", "run", "--config", str(EXAMPLE), "--no-progress"]
        run = subprocess.Popen(
            command + [a for o in overrides for a in ("--set", o)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        metrics, samples, started = run_dir / "metrics.jsonl", [], time.perf_counter()
        try:
            while run.poll() is None:
                time.sleep(every_s)
                engine = psutil.Process(run.pid).children(recursive=True)
                rss = 0
                for process in engine:
                    try:
                        rss += process.memory_info().rss
                    except psutil.NoSuchProcess:
                        continue
                updates = len(metrics.read_text().splitlines()) if metrics.exists() else 0
                if updates >= steps:  # the run is ending: its engine is being shut down
                    continue
                if engine and updates:
                    samples.append(
                        {"updates": updates, "engine_rss_mib": rss / 2**20, "s": time.perf_counter() - started}
                    )
        finally:
            if run.poll() is None:
                run.kill()
        if run.returncode != 0:
            raise RuntimeError(f"streamppo run exited with {run.returncode}")
    return {"steps": steps, "settings": list(settings), "wall_s": time.perf_counter() - started, "samples": samples}


if __name__ == "__main__":
    import json

    print(json.dumps(engine_memory(int(sys.argv[1]) if len(sys.argv) > 1 else 600), indent=1))
