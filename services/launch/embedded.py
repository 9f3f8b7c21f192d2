"""The embedded run: one replica of every role in one process over the in-memory bus, the same service classes.

Services take turns in one thread (a step of each replica, downstream first), which makes a seeded run reproducible. If
a full round does no work before the run is over, the pipeline is stalled, and the error says what each service
waits for.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from tqdm import tqdm

from common.config import RunConfig
from common.statistics import progress_labels
from services.ops.runlog.archive import archive_bus
from services.ops.summary import RunSummary, summarise_run
from services.roles import pipeline_topics, roles_of
from services.runtime import Replica
from services.transport import MemoryBus

log = logging.getLogger(__name__)

__all__ = ["LOG_DIR", "PipelineStalled", "RunSummary", "clear_earlier_run", "run_embedded"]

LOG_DIR = "log"  # <run.dir>/log: the run's log, archived at its end (run.archive_log)


class PipelineStalled(RuntimeError):
    """No service can make progress, yet the run is not finished."""


# What a run leaves in its directory that a new run of it must not take for its own: its updates, its summary and
# outcome, its last status, its archived log.
EARLIER_RESULTS = ("metrics.jsonl", "eval.jsonl", "summary.json", "outcome.json", "status.json", LOG_DIR)


def clear_earlier_run(config: RunConfig) -> str | None:
    """Remove an earlier run's results and checkpoints from the run directory (a learner takes up any checkpoint it
    finds, and would train nothing of a finished run, yet report it); what was removed, to be said, or None."""
    run_dir, checkpoints = Path(config.run.dir), Path(config.checkpoint_dir)
    metrics = run_dir / "metrics.jsonl"
    updates = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    found = [run_dir / name for name in EARLIER_RESULTS if (run_dir / name).exists()]
    found += [checkpoints] if checkpoints.exists() else []
    for path in found:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if not found:
        return None
    return (
        f"cleared the earlier run in {run_dir} ({updates} updates, its checkpoints and summary): this run starts "
        "from scratch"
    )


def _start_from_scratch(config: RunConfig) -> Path:
    """The in-memory bus starts empty, so the run does too: an earlier run's results in the run dir go."""
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cleared = clear_earlier_run(config)
    if cleared:
        log.warning("%s (an embedded run always does)", cleared)
    # The settings as given, defaults left out: what `load_config` takes back (streamppo replay).
    (run_dir / "config.json").write_text(config.model_dump_json(indent=2, exclude_unset=True))
    return run_dir


def _progress_bar(total: int, enabled: bool):
    bar = tqdm(total=total, desc="ppo", unit="step", disable=not enabled, dynamic_ncols=True)

    def on_record(record: dict) -> None:
        if "step" not in record:
            return
        bar.update(1)
        shown = progress_labels()
        bar.set_postfix({label: f"{record[key]:.4g}" for label, key in shown.items() if key in record})

    return bar, on_record


def run_embedded(config: RunConfig, progress: bool = True, bus: MemoryBus | None = None) -> RunSummary:
    """Run the pipeline to its end; ``bus``: the in-memory bus to run it over (a new one by default), for a caller
    that reads the topics afterwards."""
    started = time.time()
    run_dir = _start_from_scratch(config)
    bus = bus or MemoryBus()
    bus.create_topics(pipeline_topics())
    bar, on_record = _progress_bar(config.run.steps, progress)
    built, replicas, finished = {}, [], False
    # Downstream first: in one round every stage works on a different batch, as concurrent services would, so
    # max_staleness > 0 really lets generation run ahead of training.
    order = list(reversed(roles_of(config)))
    try:
        # Built sources first, then downstream first: the generator, whose engine takes the longest to start, comes
        # last, so a bad setting of any other role (a dataset, a reward function) is reported within seconds.
        for role in sorted(order, key=lambda role: role.input_topic is not None):
            built[role.name] = role.create(config)
            built[role.name].observe(on_record)
        for role in order:
            replicas.append(Replica(built.pop(role.name), lambda: bus).start())
        ending = [replica.service for replica in replicas if replica.service.spec.ends_run]
        while not all(service.done() for service in ending):
            if not any([replica.step() for replica in replicas]):
                raise PipelineStalled("; ".join(f"{r.replica_id}: {r.runner.waiting_for()}" for r in replicas))
        finished = True
    finally:
        bar.close()
        for replica in replicas:
            replica.stop(finished)
        for service in built.values():  # created, never started
            service.close()
    if config.run.archive_log:  # once every service finished: the learner's last announcement is on it
        archive_bus(bus, run_dir / LOG_DIR, config.run.run_id)
    dead_letters = sum(replica.runner.counters["dead_letters"] for replica in replicas)
    summary = summarise_run(run_dir, dead_letters, config.run.steps, wall_seconds=time.time() - started)
    return summary
