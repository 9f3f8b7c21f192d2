"""streamppo's GRPO against TRL's GRPOTrainer on the arithmetic recipe, over seeds: held-out accuracy (greedy, by
evaluate.py) and training reward of each run, and their means.

    python examples/arithmetic/compare_trl.py RUN_DIR [--runs ours trl ...]

Reads ``RUN_DIR/eval/<name>-<seed>.json`` for every seed found, ``RUN_DIR/<name>-<seed>/metrics.jsonl`` (streamppo:
one line per update; TRL: its log history, the reward logged once per generation batch) and the wall times
(``<name>-<seed>.seconds`` or ``<name>-<seed>/seconds``); prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def training_rewards(run: Path) -> list[float]:
    """The mean reward of each update, in order."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    key = "reward_mean" if any("reward_mean" in line for line in lines) else "reward"
    return [line[key] for line in lines if key in line]


def seconds(root: Path, run: str) -> float | None:
    for path in (root / f"{run}.seconds", root / run / "seconds"):
        if path.exists() and path.read_text().strip().isdigit():
            return float(path.read_text())
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--runs", nargs="+", default=["ours", "trl"])
    args = parser.parse_args()
    root = args.run_dir
    print("| run | seed | held-out accuracy | training reward, first → last 3 updates | wall time |")
    print("|---|---|---|---|---|")
    for name in args.runs:
        accuracies = []
        for path in sorted((root / "eval").glob(f"{name}-*.json")):
            match = re.fullmatch(rf"{re.escape(name)}-(\d+)", path.stem)
            if match is None:
                continue
            seed, run = int(match.group(1)), f"{name}-{match.group(1)}"
            verdict = json.loads(path.read_text())
            accuracies.append(verdict["accuracy"])
            rewards = training_rewards(root / run)
            first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
            wall = seconds(root, run)
            print(
                f"| {name} | {seed} | {verdict['accuracy']:.3f} ({verdict['correct']}/{verdict['problems']}) | "
                f"{first:.3f} → {last:.3f} | {'-' if wall is None else f'{wall:.0f} s'} |"
            )
        if accuracies:
            mean, spread = statistics.mean(accuracies), statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
            print(f"| **{name}, mean of {len(accuracies)}** | | **{mean:.3f}** ± {spread:.3f} (sd) | | |")


if __name__ == "__main__":
    main()
