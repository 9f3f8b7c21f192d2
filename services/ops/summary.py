"""A finished run in a few numbers: ``summary.json`` in the run directory and the ``done:`` line, the same for every
runner (``streamppo run``, ``up``, and ``wait`` for a run deployed with docker-compose or Helm).

Read from the learner's ``metrics.jsonl``, so a run whose services ran in other processes or containers is summed up
alike from its run directory.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from common.report import load_metrics, read_outcome, summarise

__all__ = ["RunSummary", "summarise_run"]


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    steps: int
    dropped_stale: int  # groups, too stale (or of an impossible version) to train on
    no_signal_groups: int  # groups dropped by dynamic sampling
    dead_letters: int
    summary_window: int  # updates averaged for reward_start / reward_end / kl_end (common.report.summarise)
    reward_start: float
    reward_end: float
    kl_end: float
    wall_seconds: float
    steps_planned: int = 0  # run.steps (0: not known, a summary.json of an older build)
    ended_short: str = ""  # why the run ended before run.steps updates, with the setting that applies ("": it did not)

    def done_line(self) -> str:
        head = f"done: {self.steps} steps"
        if self.ended_short:
            head = f"ENDED SHORT: {self.steps} of {self.steps_planned} steps ({self.ended_short})"
        return (
            f"{head} in {self.wall_seconds:.0f}s; mean reward {self.reward_start:.3f} -> "
            f"{self.reward_end:.3f}; KL {self.kl_end:.4f}; groups dropped: stale {self.dropped_stale}, "
            f"no signal {self.no_signal_groups}; dead letters {self.dead_letters}\nrun directory: {self.run_dir}"
        )


def summarise_run(
    run_dir: Path, dead_letters: int, steps_planned: int, wall_seconds: float | None = None
) -> RunSummary:
    """The summary of the run in ``run_dir`` (of ``steps_planned`` updates: run.steps), written to its
    ``summary.json``; ``wall_seconds`` by default the time of the last update since the learner started. A run with
    fewer updates ended short: the learner's outcome says why (else, that its log does)."""
    try:
        records = load_metrics(run_dir)  # the run summary and `streamppo report` average the same windows
    except ValueError:  # no update (dynamic sampling that found no signal in any prompt batch)
        records = []
    figures = summarise(records) if records else {"window": 0, "metrics": {}}
    nothing = {"first": float("nan"), "last": float("nan")}
    window = {key: figures["metrics"].get(key, nothing) for key in ("reward_mean", "kl")}
    if wall_seconds is None:
        wall_seconds = float(records[-1].get("time", 0.0)) if records else 0.0
    summary = RunSummary(
        run_dir=str(run_dir),
        steps=len(records),
        dropped_stale=records[-1]["dropped_stale"] if records else 0,
        no_signal_groups=records[-1].get("no_signal_groups", 0) if records else 0,
        dead_letters=dead_letters,
        summary_window=figures["window"],
        reward_start=window["reward_mean"]["first"],
        reward_end=window["reward_mean"]["last"],
        kl_end=window["kl"]["last"],
        wall_seconds=wall_seconds,
        steps_planned=steps_planned,
        ended_short=(
            (read_outcome(run_dir).get("shortfall") or "the learner's log says why")
            if len(records) < steps_planned
            else ""
        ),
    )
    (Path(run_dir) / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary
