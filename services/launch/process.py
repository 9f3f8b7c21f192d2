"""One service replica as its own process over Kafka: ``streamppo <role>`` for every role in ``ROLES``.

SIGTERM (or Ctrl-C) lets the batch in hand finish, be produced and committed, then exits 0; a batch not yet
started stays uncommitted and is re-delivered to another replica. A replica that is only waiting (for input, for
weights, for a broker that is away) stops at once. What the broker must do at the end (the last status report,
the commit, leaving the group) gets ``STOP_BROKER_S``: a broker that does not answer by then is left, and the
uncommitted input is delivered again. A replica whose service is done (the feeder once the learner settled every
prompt batch, the learner after ``run.steps`` updates) finishes and exits 0. When the broker loses the run's log, the
replica goes on on the new one in this process (:meth:`~services.service.Service.take_up_new_log`), or, for a service
that cannot, exits ``exit_codes.LOG_REPLACED`` (4) to be started again in resume mode.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from kafka.errors import KafkaError

from common.config import ConfigError, RunConfig
from common.schema import ReplicaStatus, encode
from services.launch.host import (
    STOP_BROKER_S,
    StatusCadence,
    StopFlag,
    broker_deadline,
    default_replica_id,
    host_loop,
    report_status,
    serve_metrics,
)
from services.roles import ROLES, STATUS_TOPIC
from services.runtime import Replica, exit_codes
from services.runtime.metrics import ServiceMetrics
from services.runtime.run_bus import bootstrap_of, kafka_bus
from services.service import ProcessGroup, Service
from services.transport import Bus

log = logging.getLogger(__name__)

__all__ = ["STOP_BROKER_S", "default_replica_id", "say_starting", "serve", "serve_service"]


def serve(
    role: str,
    config: RunConfig,
    bootstrap: str | None,
    replica_id: str | None = None,
    metrics_port: str | None = None,
    metrics_address: str = "0.0.0.0",
    metrics_targets: Path | None = None,
) -> int:
    """Run one replica of ``role``. ``metrics_port``: a port or a range (``9110-9129``: the first free one) for
    ``/metrics`` on ``metrics_address``; ``metrics_targets``: a folder to register that address in for Prometheus'
    file-based discovery (:class:`~services.runtime.metrics.ScrapeTarget`)."""
    if not ROLES[role].runs_when(config):
        raise ConfigError(f"this run has no {role} role: it needs {ROLES[role].requirement}")
    replica_id = replica_id or default_replica_id(role)
    bootstrap = bootstrap_of(config, bootstrap)  # before the models load
    group = ROLES[role].service_class().process_group(config)
    if group is not None and (code := group.launch()) is not None:
        return code  # this process launched and supervised the group's processes
    leader = group is None or group.leads()
    # A follower has no batch of its own to finish: a signal ends it at once (rank 0 decides what is kept).
    stop = StopFlag(replica_id) if leader else None
    metrics = ServiceMetrics(role)
    # Before the models load: a port in use is a mistake to report at once.
    target = serve_metrics(
        metrics, replica_id, role, metrics_port if leader else None, metrics_address, metrics_targets
    )
    try:
        # The run's bus is made, and the replica says it is starting, while its models load; a configuration error in
        # them is still said first, whatever the broker does.
        starting = _Starting(config, bootstrap, role, replica_id) if leader else None
        service = ROLES[role].create(config, replica_id)
        bus = starting.bus() if starting is not None else None
        return serve_service(service, config, bootstrap, metrics, stop, bus=bus, group=group)
    except Exception as exc:
        gone = group.peer_gone(exc) if group is not None else None
        if gone is None:
            raise
        log.error("%s: %s; exiting", replica_id, gone)
        return exit_codes.ERROR
    finally:
        if target is not None:
            target.remove()


class _Starting:
    """In a thread of its own: the run's bus (its topics made), then one report on the status topic while the replica
    builds its service (models, an engine: minutes on a CPU), so that ``streamppo status`` shows what is loading."""

    def __init__(self, config: RunConfig, bootstrap: str, role: str, replica_id: str):
        self.made: list = []  # the bus, or the error that making it raised
        self.thread = threading.Thread(
            target=self._run, args=(config, bootstrap, role, replica_id), name=f"{replica_id}-starting", daemon=True
        )
        self.thread.start()

    def _run(self, config: RunConfig, bootstrap: str, role: str, replica_id: str) -> None:
        try:
            bus = kafka_bus(config, bootstrap)
        except Exception as exc:  # raised to the replica by bus(), as making the bus there would
            self.made.append(exc)
            return
        self.made.append(bus)
        say_starting(bus, config, role, replica_id)

    def bus(self) -> Bus:
        """The bus once it is made (the wait serve_service would have had); raises what making it raised."""
        self.thread.join()
        if isinstance(self.made[0], Exception):
            raise self.made[0]
        return self.made[0]


def say_starting(bus: Bus, config: RunConfig, role: str, replica_id: str) -> None:
    """One report of a replica that is building its service (``starting``, and what loads) on the status topic."""
    m = config.model
    report = ReplicaStatus(
        replica=replica_id,
        role=role,
        run_id=config.run.run_id,
        state="starting",
        waiting_for=f"building its service: the models it runs load first (model.actor {m.actor}, on {m.device})",
        held=0,
        held_seconds=0.0,
        lag=0,
        counters={},
        created_at=time.time(),
        url="",
    )
    try:
        producer = bus.producer(replica_id)
        producer.send(STATUS_TOPIC, encode(report), key=replica_id.encode())
        producer.close()
    except KafkaError as exc:  # a report is not worth failing over: the runner's come once it runs
        log.warning("%s: no starting report (%s)", replica_id, exc)


def serve_service(
    service: Service,
    config: RunConfig,
    bootstrap: str | None,
    metrics: ServiceMetrics | None = None,
    stop: StopFlag | None = None,
    bus: Bus | None = None,
    group: ProcessGroup | None = None,
) -> int:
    """Run a constructed replica over Kafka (``bus``, by default the one ``config`` describes) until it is done or a
    signal stops it: what :func:`serve` does once its service is built. In a following process of a ``group``, run
    what its leader leads instead."""
    role, replica_id = service.role, service.replica_id
    if group is not None and not group.leads():
        try:
            group.follow(service)
        finally:
            service.close()
        return 0
    metrics = metrics or ServiceMetrics(role)
    stop = stop or StopFlag(replica_id)
    service.observe(metrics.observe)
    given = [bus] if bus is not None else []  # the first log's bus; after a lost log, the new log's

    def bus_of() -> Bus:
        return given.pop() if given else kafka_bus(config, bootstrap)

    replica, code = Replica(service, bus_of, metrics), exit_codes.OK
    try:
        replica.start()
        log.info("%s: serving %s -> %s", replica_id, service.input_topic or "(nothing)", service.output_topic)
        host_loop(ReplicaHost(replica), stop)
        if replica.ended:
            code = exit_codes.LOG_REPLACED
    except BaseException:
        code = exit_codes.ERROR  # what the process exits with if the broker's part of closing runs out of time
        raise
    finally:
        replica.stop(
            finished=code == exit_codes.OK,
            report=lambda runner, state: report_status(runner, state),
            broker_within=lambda: broker_deadline(replica_id, code),
        )
        if replica.runner is not None:  # one parseable line: where this replica's time went (benchmarks/ reads it)
            log.info("%s: time breakdown %s", replica_id, json.dumps({"role": role, **replica.runner.time_breakdown()}))
    if code == exit_codes.OK and replica.shortfall:
        log.error("%s: %s", replica_id, replica.shortfall)
        code = exit_codes.RUN_SHORT
    return code


class ReplicaHost:
    """One replica, driven by the host loop: its status told on the cadence, one step of it at a time."""

    def __init__(self, replica: Replica):
        self.replica, self.name = replica, replica.replica_id
        self.cadence = StatusCadence(lambda runner, say: report_status(runner, say=say))

    def done(self) -> bool:
        return self.replica.service.done() or self.replica.ended

    def busy(self) -> bool:
        runner = self.replica.runner
        return runner is not None and runner.processing

    def on_time(self, now: float) -> None:
        self.cadence.tell(self.replica.runner, now)

    def step(self, go_on: bool) -> None:
        self.replica.step(timeout_s=0.5, go_on=go_on)
