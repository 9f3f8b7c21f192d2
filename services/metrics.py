"""Prometheus metrics of one service replica (prometheus-client), served on ``/metrics`` when a port is given.

Every replica exports throughput, per-stage latency, consumer lag, dead letters and the policy version it works
with; the learner adds its training statistics. Names start with ``streamppo_``; every series carries the
``role`` label, so one dashboard query covers all replicas of a role.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from common.statistics import LEARNER_STATISTICS, gauges

__all__ = ["ScrapeTarget", "ServiceMetrics", "parse_ports"]


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
        self.counted = Gauge(
            "streamppo_service_count",
            "What a service counts beyond its input's outcomes (a gateway's calls, retries, episodes by outcome).",
            ["role", "name"],
            registry=r,
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

    def serve_on_first_free(self, ports: range, address: str = "0.0.0.0") -> int:
        """Serve on the first port of ``ports`` that is free; returns it. Replicas on one host network (compose's
        ``network_mode: host``, ``--scale scorer=3``) share one command, so each takes the next port of a range."""
        error = None
        for port in ports:
            try:
                self.serve(port, address)
                return port
            except OSError as exc:
                error = exc
        raise error


def parse_ports(spec: str) -> range:
    """``"9100"`` -> the port 9100; ``"9110-9129"`` -> those ports (the first free one is taken)."""
    first, sep, last = spec.partition("-")
    if not (first.isdigit() and (not sep or last.isdigit())):
        raise ValueError(f"--metrics-port {spec!r}: expected PORT or FIRST-LAST, e.g. 9100 or 9110-9129")
    ports = range(int(first), int(last if sep else first) + 1)
    if not ports or not (0 < ports[0] and ports[-1] < 65536):
        raise ValueError(f"--metrics-port {spec!r}: expected ports from 1 to 65535, the first no greater than the last")
    return ports


class ScrapeTarget:
    """This replica's ``/metrics`` address as a Prometheus file-based discovery file (``file_sd_configs``), in a folder
    every replica writes to and Prometheus reads: where no DNS names the replicas (containers on the host network),
    Prometheus finds each, however many there are and whatever port each took. Removed when the replica stops; a
    killed replica's file stays, and its target shows as down until the replica is back."""

    def __init__(self, folder: Path, replica_id: str, role: str, address: str, port: int):
        self.path = Path(folder) / f"{replica_id}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"targets": [f"{address}:{port}"], "labels": {"service": role, "replica": replica_id}}
        written = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        written.write_text(json.dumps([entry]))
        written.replace(self.path)  # Prometheus never reads half a file

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
