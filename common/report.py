"""A run directory as plots and a table: ``streamppo report RUN_DIR``.

Reads ``metrics.jsonl`` (one line per PPO update, written by the learner), draws one PNG per quantity into
``RUN_DIR/report/`` and returns a summary of the first and last updates. With ``tensorboard=True`` it also writes
the same series as TensorBoard scalars (``RUN_DIR/tensorboard``).
"""

from __future__ import annotations

import json
from pathlib import Path

from common.statistics import PLOTS, plotted, summarised

__all__ = [
    "EVAL_FILE",
    "OUTCOME_FILE",
    "format_summary",
    "load_eval",
    "load_metrics",
    "read_outcome",
    "summarise",
    "summary_window",
    "write_report",
]

# <run.dir>/outcome.json, written by the learner as the run finishes: its updates, run.steps, and why it ended short
# ("" when it did not). Removed when a learner starts: a run that goes on has no outcome yet.
OUTCOME_FILE = "outcome.json"
# <run.dir>/eval.jsonl: the evaluator's line per actor version it scored on the held-out prompts.
EVAL_FILE = "eval.jsonl"


def load_eval(run_dir: Path) -> list[dict]:
    """The evaluator's lines of the run in ``run_dir`` (``eval.jsonl``), by actor version; [] without one."""
    path = Path(run_dir) / EVAL_FILE
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(lines, key=lambda line: line["policy_version"])


def read_outcome(run_dir: Path) -> dict:
    """The learner's outcome of the run in ``run_dir`` ({} when it has not finished or the file cannot be read)."""
    try:
        outcome = json.loads((Path(run_dir) / OUTCOME_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return outcome if isinstance(outcome, dict) else {}


def load_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a streamppo run directory?")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} has no updates yet")
    for r in records:  # sequences per second of each stage's compute, from the seconds carried in the lineage
        seconds = {"learner": r.get("train_seconds")} | {
            k.removeprefix("seconds_"): v for k, v in r.items() if k.startswith("seconds_")
        }
        for stage, s in seconds.items():
            if s and r.get("sequences"):
                r[f"throughput_{stage}"] = r["sequences"] / s
    return records


def _window(records: list[dict], key: str, first: bool, size: int) -> float | None:
    values = [r[key] for r in (records[:size] if first else records[-size:]) if key in r]
    return sum(values) / len(values) if values else None


def summary_window(updates: int) -> int:
    """How many updates a run's "first" and "last" figures average: 5, or half the run if it is shorter.

    The one definition: ``streamppo run`` prints, and ``streamppo report`` tabulates, the same windows.
    """
    return max(1, min(5, updates // 2))


def summarise(records: list[dict]) -> dict:
    """Mean of each key over the first and the last :func:`summary_window` updates."""
    size = summary_window(len(records))
    rows = {
        key: {"first": _window(records, key, True, size), "last": _window(records, key, False, size)}
        for key in summarised()
        if any(key in r for r in records)
    }
    return {"updates": len(records), "window": size, "wall_seconds": records[-1].get("time"), "metrics": rows}


def format_summary(summary: dict) -> str:
    lines = [
        f"{summary['updates']} updates, {summary['wall_seconds']:.0f} s; means over the first and last "
        f"{summary['window']} updates:",
        f"{'metric':<22}{'first':>12}{'last':>12}",
    ]
    for key, row in summary["metrics"].items():
        first = "-" if row["first"] is None else f"{row['first']:.4g}"
        last = "-" if row["last"] is None else f"{row['last']:.4g}"
        lines.append(f"{key:<22}{first:>12}{last:>12}")
    if "held_out" in summary:
        first, last = summary["held_out"]["first"], summary["held_out"]["last"]
        lines.append(
            f"held-out reward (the evaluator): {first['eval_reward_mean']:.4g} at v{first['step']} -> "
            f"{last['eval_reward_mean']:.4g} at v{last['step']}"
        )
    return "\n".join(lines)


def draw(name: str, records: list[dict]):
    """The matplotlib figure of plot ``name`` (:data:`common.statistics.PLOTS`) of a run's metrics records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    plot = PLOTS[name]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    right = ax.twinx() if any(on_right for _, _, on_right in plotted(name)) else None
    lines, values = [], []
    for index, (key, label, on_right) in enumerate(plotted(name)):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            axis = right if on_right else ax
            lines += axis.plot(*zip(*points), marker="." if len(points) < 50 else None, label=label, color=f"C{index}")
            if on_right:
                right.set_ylim(0, max(value for _, value in points) * 1.2 or 1.0)  # a coefficient: from 0
            else:
                values += [value for _, value in points]
    if not lines:
        ax.text(0.5, 0.5, "not recorded in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(plot.title)
    ax.set_xlabel("PPO update")
    ax.set_ylabel(plot.ylabel)
    if right is not None:
        right.set_ylabel(plot.right_ylabel)
    if plot.whole_numbers:
        ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if values:
            ax.set_ylim(min(0, min(values)) - 0.5, max(1, max(values)) + 0.5)
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(lines, [line.get_label() for line in lines])
    fig.tight_layout()
    return fig


def write_report(run_dir: Path, tensorboard: bool = False) -> tuple[list[Path], dict]:
    """Draw the PNGs into ``run_dir/report``; returns their paths and the summary."""
    import matplotlib.pyplot as plt

    records = load_metrics(run_dir)
    out = Path(run_dir) / "report"
    out.mkdir(exist_ok=True)
    paths = []
    evaluated = [
        {"step": line["policy_version"], "eval_reward_mean": line["reward_mean"]} for line in load_eval(run_dir)
    ]
    for name in PLOTS:
        fig = draw(name, records + evaluated)
        path = out / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    summary = summarise(records)
    if evaluated:
        summary["held_out"] = {"first": evaluated[0], "last": evaluated[-1]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        with SummaryWriter(str(Path(run_dir) / "tensorboard")) as writer:
            for r in records:
                for key, value in r.items():
                    if isinstance(value, (int, float)) and key != "step":
                        writer.add_scalar(key, value, r["step"])
    return paths, summary
