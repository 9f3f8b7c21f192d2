"""One service as its own process over Kafka: ``streamppo generator|scorer|advantage|learner|feed``.

SIGTERM (or Ctrl-C) lets the batch in hand finish, be produced and committed, then exits 0; a batch not yet
started stays uncommitted and is re-delivered to another replica.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time

from kafka.errors import KafkaError

from common.config import ConfigError, RunConfig
from services.metrics import ServiceMetrics
from services.runtime import ServiceRunner, pipeline_topics
from services.transport.kafka import KafkaBus, KafkaSettings

log = logging.getLogger(__name__)

__all__ = ["ROLES", "feed", "serve"]


def _service_class(role: str):
    from services.advantage import AdvantageService
    from services.generator import GeneratorService
    from services.learner import LearnerService
    from services.scorer import ScorerService

    return {"generator": GeneratorService, "scorer": ScorerService, "advantage": AdvantageService,
            "learner": LearnerService}[role]


ROLES = ("generator", "scorer", "advantage", "learner")
STATUS_EVERY_S = 30.0


def default_replica_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def kafka_bus(config: RunConfig, bootstrap: str | None = None) -> KafkaBus:
    """The Kafka bus the config describes, with every pipeline topic created."""
    k = config.kafka
    bootstrap = bootstrap or k.bootstrap
    if not bootstrap:
        raise ConfigError("no Kafka broker given: pass --bootstrap HOST:PORT or set kafka.bootstrap")
    bus = KafkaBus(KafkaSettings(
        bootstrap=bootstrap, max_message_bytes=k.max_message_bytes, session_timeout_ms=k.session_timeout_ms,
        heartbeat_interval_ms=k.heartbeat_interval_ms, idempotent_producer=k.idempotent_producer,
        fetch_max_wait_ms=k.fetch_max_wait_ms, security=k.client_options(),
    ))
    bus.create_topics(pipeline_topics(k.partitions))
    return bus


def serve(role: str, config: RunConfig, bootstrap: str | None, replica_id: str | None = None,
          metrics_port: int | None = None) -> int:
    replica_id = replica_id or default_replica_id(role)
    stopping = {"flag": False}

    def request_stop(signum, frame):
        log.info("%s: signal %d, stopping after the batch in hand", replica_id, signum)
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    service = _service_class(role)(config, replica_id)
    metrics = ServiceMetrics(role)
    if role == "learner":
        service.listeners.append(metrics.learner_update)
    if metrics_port:
        metrics.serve(metrics_port)
        log.info("%s: metrics on :%d/metrics", replica_id, metrics_port)
    runner = ServiceRunner(service, kafka_bus(config, bootstrap), replica_id, metrics=metrics)
    log.info("%s: serving %s -> %s", replica_id, service.input_topic, service.output_topic)
    backoff = 0.5
    next_status = time.monotonic() + STATUS_EVERY_S
    try:
        while not stopping["flag"]:
            if time.monotonic() >= next_status:
                next_status = time.monotonic() + STATUS_EVERY_S
                log.info("%s: status %s", replica_id, runner.status())
            try:
                runner.poll_once(timeout_s=0.5)
                backoff = 0.5
            except KafkaError as exc:
                # The batch in hand was not committed and comes back once the broker does.
                log.warning("%s: broker error (%s: %s); retrying in %.1fs", replica_id, type(exc).__name__, exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                continue
            if role == "learner" and service.consumed >= config.run.steps:
                service.save_final()
                log.info("%s: %d updates done", replica_id, service.updates)
                break
    finally:
        runner.close()
        # One parseable line: where this replica's time went (benchmarks/ reads it).
        log.info("%s: time breakdown %s", replica_id, json.dumps({"role": role, **runner.time_breakdown()}))
    return 0


def feed(config: RunConfig, bootstrap: str | None) -> int:
    from services.feeder import FeederService

    feeder = FeederService(config)
    count = feeder.publish(kafka_bus(config, bootstrap), range(config.run.steps))
    log.info("published %d prompt batches", count)
    return 0
