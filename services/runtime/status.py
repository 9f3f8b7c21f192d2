"""What a replica says of itself: its counters and lag, what it waits for, and its report on the status topic (the
one ``streamppo status`` and the autoscaler read), with the gauges of held input beside it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from common.schema import ReplicaStatus
from services.roles import WEIGHTS_TOPIC

if TYPE_CHECKING:
    from services.runtime.runner import ServiceRunner

__all__ = ["counters_and_lag", "replica_status", "waiting_for"]


def counters_and_lag(runner: ServiceRunner) -> dict:
    """Counters plus the consumer lag (records in this replica's partitions not yet consumed)."""
    lag = runner.work.lag() if runner.work is not None else 0
    busy = round(sum(runner.seconds.values()), 1)
    counted = {**runner.counters, **runner.service.counters()}
    in_flight = len(runner.streaming.in_flight)
    return {**counted, "lag": lag, "held": len(runner.held), "in_flight": in_flight, "busy_s": busy}


def waiting_for(runner: ServiceRunner) -> str:
    """What the replica waits for, in one line."""
    if runner.weights is not None and not runner.weights.caught_up:
        return f"reading {WEIGHTS_TOPIC} to its end: the newest weights are loaded before any input is taken"
    if not runner.held:
        in_flight = runner.streaming.in_flight
        in_hand = runner.service.in_hand() if in_flight else ""
        return f"{len(in_flight)} input(s) in hand: {in_hand}" if in_hand else "waiting for input"
    return runner.held.describe()


def replica_status(runner: ServiceRunner, state: str | None = None, counters: dict | None = None) -> ReplicaStatus:
    """The replica's report, its gauges set. ``state`` defaults to ``waiting`` while input is held, else
    ``serving``; ``counters``: more to report (a fleet's share of the replica for this run)."""
    service, metrics = runner.service, runner.metrics
    held_seconds = runner.held.oldest_seconds()
    in_hand = service.in_hand() if runner.streaming.in_flight else ""
    counted = service.counters()
    for name, value in counted.items():
        metrics.counted.labels(service.role, name).set(value)
    metrics.held_records.labels(service.role).set(len(runner.held))
    metrics.held_seconds.labels(service.role).set(held_seconds)
    loaded = runner.weights.loaded if runner.weights is not None else {}
    versions = {f"weights.{model}": version for model, version in loaded.items()}
    signed = int(runner.signer is not None)  # streamppo status says when a run is unsigned
    waiting = bool(runner.held) or bool(in_hand)
    return ReplicaStatus(
        replica=runner.replica_id,
        role=service.role,
        run_id=service.run_id,
        state=state or ("waiting" if waiting else "serving"),
        waiting_for=waiting_for(runner) if waiting else "",
        held=len(runner.held),
        held_seconds=round(held_seconds, 1),
        lag=runner.work.lag() if runner.work is not None else 0,
        counters={**runner.counters, **counted, **versions, "signed": signed, **(counters or {})},
        created_at=time.time(),
        url=service.url,
    )
