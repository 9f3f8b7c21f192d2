"""The embedded run: every service in one process over the in-memory bus, with the same service classes.

Services take turns in one thread (``poll_once`` each, downstream first), which makes a seeded run reproducible. If a full round
does no work before the last update, the pipeline is stalled, and the error says what each service waits for.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from common.config import RunConfig
from services.advantage import AdvantageService
from services.feeder import FeederService
from services.generator import GeneratorService
from services.learner import LearnerService
from services.runtime import ServiceRunner, pipeline_topics
from services.scorer import ScorerService
from services.transport import MemoryBus

log = logging.getLogger(__name__)

__all__ = ["PipelineStalled", "RunSummary", "run_embedded"]


class PipelineStalled(RuntimeError):
    """No service can make progress, yet the run is not finished."""


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    steps: int
    dropped_stale: int
    dead_letters: int
    reward_start: float
    reward_end: float
    kl_end: float
    wall_seconds: float


def _window_mean(records: list[dict], key: str, first: bool) -> float:
    width = max(1, len(records) // 10)
    window = records[:width] if first else records[-width:]
    return sum(r[key] for r in window) / len(window)


def run_embedded(config: RunConfig, progress: bool = True) -> RunSummary:
    started = time.time()
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    (run_dir / "config.json").write_text(config.model_dump_json(indent=2))

    bus = MemoryBus()
    bus.create_topics(pipeline_topics())
    feeder = FeederService(config)
    # The in-memory bus starts empty, so the run starts from scratch too.
    shutil.rmtree(config.checkpoint_dir, ignore_errors=True)
    learner = LearnerService(config, resume=False)
    # Downstream first: in one round every stage works on a different batch, as concurrent services would, so
    # max_staleness > 0 really lets generation run ahead of training.
    services = [learner, AdvantageService(config), ScorerService(config), GeneratorService(config)]
    runners = [ServiceRunner(service, bus, service.replica_id) for service in services]
    feeder.publish(bus, range(config.run.steps))

    records: list[dict] = []
    bar = tqdm(total=config.run.steps, desc="ppo", unit="step", disable=not progress, dynamic_ncols=True)

    def on_step(record: dict) -> None:
        records.append(record)
        bar.update(1)
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", kl=f"{record['kl']:.4f}",
                        pg=f"{record['policy_loss']:.3f}", vf=f"{record['value_loss']:.3f}")

    learner.listeners.append(on_step)
    try:
        while learner.consumed < config.run.steps:
            if not any([runner.poll_once() for runner in runners]):
                raise PipelineStalled("; ".join(f"{r.replica_id}: {r.waiting_for()}" for r in runners))
        learner.save_final()
    finally:
        bar.close()
        for runner in runners:
            runner.close()

    summary = RunSummary(
        run_dir=str(run_dir),
        steps=learner.updates,
        dropped_stale=learner.dropped_stale,
        dead_letters=sum(r.counters["dead_letters"] for r in runners),
        reward_start=_window_mean(records, "reward_mean", first=True) if records else float("nan"),
        reward_end=_window_mean(records, "reward_mean", first=False) if records else float("nan"),
        kl_end=_window_mean(records, "kl", first=False) if records else float("nan"),
        wall_seconds=time.time() - started,
    )
    (run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary
