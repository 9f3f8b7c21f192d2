"""The arithmetic recipe's results: held-out accuracy before and after each run, and their reward curves side by side.

    python examples/arithmetic/compare.py runs/arithmetic      # writes runs/arithmetic/results/

Reads ``eval/<run>.json`` (evaluate.py's verdicts; ``base`` and each run present), ``<run>/metrics.jsonl`` and
``<run>.seconds`` (the wall time of each ``streamppo run``), and writes ``results/results.md`` and
``results/reward.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.report import load_metrics, summarise  # noqa: E402

RUNS = {
    "ppo": "PPO (GAE, critic)",
    "grpo": "GRPO (no critic, k3 KL in the loss)",
    "grpo-dynamic": "GRPO, dynamic sampling (groups without signal dropped)",
}


def smoothed(values: list[float], width: int = 5) -> list[float]:
    """The mean of each value and the ``width − 1`` before it (fewer at the start)."""
    windows = [values[max(0, i - width + 1) : i + 1] for i in range(len(values))]
    return [sum(window) / len(window) for window in windows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    root, out = args.run_dir, args.run_dir / "results"
    out.mkdir(parents=True, exist_ok=True)
    runs = {name: label for name, label in RUNS.items() if (root / "eval" / f"{name}.json").exists()}
    accuracy = {name: json.loads((root / "eval" / f"{name}.json").read_text()) for name in ("base", *runs)}
    metrics = {name: load_metrics(root / name) for name in runs}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label in runs.items():
        steps = [r["step"] for r in metrics[name]]
        rewards = [r["reward_mean"] for r in metrics[name]]
        (line,) = ax.plot(steps, rewards, alpha=0.3)
        ax.plot(steps, smoothed(rewards), color=line.get_color(), label=f"{label} (mean of 5)")
    ax.set(xlabel="update", ylabel="mean reward (share of exact answers)", title="Arithmetic: training reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=120)

    base = accuracy["base"]
    lines = [
        "| run | held-out accuracy (greedy) | mean reward, first → last 5 updates | KL, last 5 | groups sampled "
        "(without signal) | wall time |",
        "|---|---|---|---|---|---|",
        f"| base model | {base['accuracy']:.3f} ({base['correct']}/{base['problems']}) | | | | |",
    ]
    for name, label in runs.items():
        summary = summarise(metrics[name])["metrics"]
        reward, kl = summary["reward_mean"], summary["kl"]
        seconds = float((root / f"{name}.seconds").read_text())
        a = accuracy[name]
        last = metrics[name][-1]
        trained, without = sum(len(r["groups"]) for r in metrics[name]), last.get("no_signal_groups", 0)
        lines.append(
            f"| {label} | {a['accuracy']:.3f} ({a['correct']}/{a['problems']}) | {reward['first']:.3f} → "
            f"{reward['last']:.3f} | {kl['last']:.4f} | {trained + without + last['dropped_stale']} ({without}) | "
            f"{seconds:.0f} s |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
