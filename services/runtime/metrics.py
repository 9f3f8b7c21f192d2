"""Prometheus metrics of one service replica (prometheus-client), served on ``/metrics`` when a port is given.

Every replica exports throughput, per-stage latency, consumer lag, dead letters and the policy version it works
with; the learner adds its training statistics. Names start with ``streamppo_``; every series carries the
``role`` label, so one dashboard query covers all replicas of a role. A fleet's replica (``streamppo fleet``) serves
the same series once per run, with a ``run`` label, and each run's share of the replica (``streamppo_fleet_*``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.statistics import LEARNER_STATISTICS, gauges

__all__ = ["FleetMetrics", "ScrapeTarget", "ServiceMetrics", "parse_ports"]


class _Served:
    """What serves a registry on ``/metrics``."""

    registry: CollectorRegistry

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


class ServiceMetrics(_Served):
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


class FleetMetrics(_Served):
    """The ``/metrics`` of a fleet's replica, read at each scrape: every run's :class:`ServiceMetrics` series with a
    ``run`` label, and per run its share of the replica. ``runs()``: each run's metrics; ``shares()``: each run's
    share (:meth:`services.launch.fleet.Fleet.shares`)."""

    def __init__(self, role: str, runs: Callable[[], dict[str, ServiceMetrics]], shares: Callable[[], dict[str, dict]]):
        self.role, self.runs, self.shares = role, runs, shares
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self):
        merged: dict[str, Metric] = {}
        for run_id, metrics in self.runs().items():
            for family in metrics.registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples += [sample._replace(labels={**sample.labels, "run": run_id}) for sample in family.samples]
        yield from merged.values()
        labels = ["role", "run"]
        share = GaugeMetricFamily(
            "streamppo_fleet_share", "A run's configured share (weight) of the replica.", labels=labels
        )
        fraction = GaugeMetricFamily(
            "streamppo_fleet_share_fraction",
            "A run's share over the shares of every run the replica serves.",
            labels=labels,
        )
        used = GaugeMetricFamily(
            "streamppo_fleet_compute_fraction",
            "The fraction of the replica's compute seconds a run used.",
            labels=labels,
        )
        seconds = CounterMetricFamily(
            "streamppo_fleet_compute_seconds", "Compute seconds of a run's turns.", labels=labels
        )
        tokens = CounterMetricFamily("streamppo_fleet_tokens", "Response tokens of a run's turns.", labels=labels)
        quota = GaugeMetricFamily(
            "streamppo_fleet_quota_tokens_per_second", "A run's quota (runs with one).", labels=labels
        )
        runs = GaugeMetricFamily("streamppo_fleet_runs", "Runs the replica serves.", labels=["role"])
        served = self.shares()
        for run_id, s in served.items():
            share.add_metric([self.role, run_id], s["share"])
            fraction.add_metric([self.role, run_id], s["share_fraction"])
            used.add_metric([self.role, run_id], s["seconds_fraction"])
            seconds.add_metric([self.role, run_id], s["seconds"])
            tokens.add_metric([self.role, run_id], s["tokens"])
            if s["quota_tokens_per_s"] is not None:
                quota.add_metric([self.role, run_id], s["quota_tokens_per_s"])
        runs.add_metric([self.role], len(served))
        yield from (share, fraction, used, seconds, tokens, quota, runs)


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
