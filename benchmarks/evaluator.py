"""What the evaluator costs the learner: the vowels example under ``streamppo up`` without it and with it, side by
side in one run, alternating (``--trials`` pairs), each on an Apache Kafka broker of its own.

The learner's update rate is taken from its own lines (``metrics.jsonl``'s ``time``): updates per second from its
second update to its last, so that start-up (model loads, the engine's start) is left out. With the evaluator, its
evaluations (``eval.jsonl``) are counted and their seconds summed: the work it did beside the learner on the same
cores.

Run: ``python -m benchmarks.evaluator [--steps 24] [--every 4] [--trials 1]`` (prints JSON; the numbers go to
benchmarks/RESULTS.md by hand, section 20). Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "vowels"


def run(folder: Path, steps: int, every: int | None) -> dict:
    settings = [f"run.dir={folder / 'run'}", f"run.steps={steps}", "run.run_id=" + folder.name, "data.eval_prompts=0"]
    if every is not None:
        settings += [f"eval.prompts={EXAMPLE / 'heldout.jsonl'}", f"eval.every={every}"]
    command = [sys.executable, "-m", "services.cli", "up", "--config", str(EXAMPLE / "config.yaml")]
    command += [arg for setting in settings for arg in ("--set", setting)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"up exited {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    times = [json.loads(line)["time"] for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    rate = (len(times) - 1) / (times[-1] - times[0])
    out = {"updates": len(times), "updates_per_s": round(rate, 4), "first_update_s": round(times[0], 1)}
    evaluated = folder / "run" / "eval.jsonl"
    if evaluated.exists():
        lines = [json.loads(line) for line in evaluated.read_text().splitlines()]
        out |= {
            "evaluations": [line["policy_version"] for line in lines],
            "eval_seconds": round(sum(line["seconds"] for line in lines), 2),
            "held_out_reward": [round(line["reward_mean"], 4) for line in lines],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--trials", type=int, default=1)
    args = parser.parse_args()
    rows = {"without": [], "with": []}
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            for name, every in (("without", None), ("with", args.every)):
                rows[name].append(run(Path(tmp) / f"{name}-{trial}", args.steps, every))
    rates = {name: statistics.mean(r["updates_per_s"] for r in runs) for name, runs in rows.items()}
    print(
        json.dumps(
            {
                "benchmark": "evaluator",
                "steps": args.steps,
                "every": args.every,
                "runs": rows,
                "learner_rate_with_over_without": round(rates["with"] / rates["without"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
