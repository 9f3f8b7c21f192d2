"""Prometheus metrics of one service replica (prometheus-client), served on ``/metrics`` when a port is given.

Every replica exports throughput, per-stage latency, consumer lag, dead letters and the policy version it works
with; the learner adds its training statistics. Names start with ``streamppo_``; every series carries the
``role`` label, so one dashboard query covers all replicas of a role.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from common.statistics import LEARNER_STATISTICS, gauges

__all__ = ["ServiceMetrics"]


class ServiceMetrics:
    def __init__(self, role: str, registry: CollectorRegistry | None = None):
        self.role = role
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.batches = Counter("streamppo_batches", "Input records by outcome.", ["role", "outcome"], registry=r)
        self.sequences = Counter(
            "streamppo_sequences",
            "Input sequences processed (prompts for the generator, responses downstream).",
            ["role"],
            registry=r,
        )
        self.tokens = Counter(
            "streamppo_tokens", "Response tokens processed (generated, for the generator).", ["role"], registry=r
        )
        self.stage_seconds = Histogram(
            "streamppo_stage_seconds",
            "Time to process one batch (decode excluded).",
            ["role"],
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.lag = Gauge(
            "streamppo_consumer_lag", "Records in this replica's partitions not yet consumed.", ["role"], registry=r
        )
        self.held_records = Gauge(
            "streamppo_held_records",
            "Input records held back until the service is ready for them.",
            ["role"],
            registry=r,
        )
        self.held_seconds = Gauge(
            "streamppo_held_seconds", "How long the oldest held input record has waited.", ["role"], registry=r
        )
        self.policy_version = Gauge(
            "streamppo_policy_version", "Policy version of the weights in use.", ["role"], registry=r
        )
        self.staleness = Gauge(
            "streamppo_staleness", "Versions between the learner and the batch it trained on.", ["role"], registry=r
        )
        self.learner = {
            name: Gauge(f"streamppo_learner_{name}", f"Of the last update: {LEARNER_STATISTICS[name].doc}.", registry=r)
            for name in gauges()
        }

    def count(self, outcome: str, sequences: int = 0, seconds: float | None = None, tokens: int = 0) -> None:
        self.batches.labels(self.role, outcome).inc()
        if sequences:
            self.sequences.labels(self.role).inc(sequences)
        if tokens:
            self.tokens.labels(self.role).inc(tokens)
        if seconds is not None:
            self.stage_seconds.labels(self.role).observe(seconds)

    def observe(self, record: dict) -> None:
        """A record a service reported (:meth:`Service.report`): the learner's statistics become gauges."""
        for name, gauge in self.learner.items():
            if name in record:
                gauge.set(record[name])
        self.staleness.labels(self.role).set(record.get("staleness", 0.0))
        self.policy_version.labels(self.role).set(record.get("policy_version", 0.0))

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        start_http_server(port, addr=address, registry=self.registry)
