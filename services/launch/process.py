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
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from kafka.errors import KafkaError

from common.config import ConfigError, RunConfig
from common.schema import REPORT_EVERY_S, ReplicaStatus, encode
from services.launch.fleet import Fleet, RunsFolder
from services.roles import ROLES, STATUS_TOPIC
from services.runtime import Replica, ServiceRunner, exit_codes
from services.runtime.metrics import FleetMetrics, ScrapeTarget, ServiceMetrics, parse_ports
from services.runtime.run_bus import bootstrap_of, kafka_bus
from services.service import ProcessGroup, Service
from services.transport import Bus

log = logging.getLogger(__name__)

__all__ = ["default_replica_id", "say_starting", "serve", "serve_fleet", "serve_service"]

STATUS_EVERY_S = REPORT_EVERY_S
# The status topic is also told within this of a change of the counters, so that status and wait are never a
# cadence behind what a replica did; the log line stays at STATUS_EVERY_S.
STATUS_CHANGED_S = 2.0
STALL_WARNING_S = 120.0
STOP_BROKER_S = 5.0  # what a stopping replica waits for the broker, at most
RESCAN_S = 5.0  # how often a fleet looks for runs added to or removed from its folder


def default_replica_id(role: str) -> str:
    """``role-host-pid``; in a container, ``role-<container id>``: containers on the host network share its host
    name, and each one's service is its PID 1. A container keeps its id across restarts, so a restarted replica
    reports under the same name."""
    container = _container_id()
    return f"{role}-{container[:12]}" if container else f"{role}-{socket.gethostname()}-{os.getpid()}"


def _container_id(mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The id of the Docker container this process runs in (its /etc/hostname is mounted from the container's
    folder, on every cgroup version), or None outside one."""
    try:
        text = open(mountinfo).read()
    except OSError:
        return None
    found = re.search(r"/containers/([0-9a-f]{64})/hostname", text)
    return found.group(1) if found else None


class _Stop(Exception):
    """Raised by a signal into a replica that is only waiting: nothing of a batch is in hand."""


class _StopFlag:
    """Set by SIGTERM or SIGINT: the loop stops after the batch in hand, or at once while it only waits."""

    def __init__(self, replica_id: str):
        self.replica_id, self.set = replica_id, False
        # Whether the loop only waits now (for input, for a broker), so that a signal may cut it short; None: never.
        self.waiting: Callable[[], bool] | None = None
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)

    def _request(self, signum, frame) -> None:
        log.info("%s: signal %d, stopping after the batch in hand", self.replica_id, signum)
        self.set = True
        if self.waiting is not None and self.waiting():
            raise _Stop  # e.g. out of a metadata request to a broker that is away, which can block for minutes


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
    stop = _StopFlag(replica_id) if leader else None
    metrics = ServiceMetrics(role)
    # Before the models load: a port in use is a mistake to report at once.
    target = _serve_metrics(
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


def _serve_metrics(
    metrics: ServiceMetrics | FleetMetrics,
    replica_id: str,
    role: str,
    port_spec: str | None,
    address: str,
    targets: Path | None,
) -> ScrapeTarget | None:
    """Serve ``/metrics`` on the first free port of ``port_spec`` (none: not served), registered in ``targets`` for
    Prometheus' file-based discovery if given; returns that registration."""
    if not port_spec:
        return None
    try:
        port = metrics.serve_on_first_free(parse_ports(port_spec), address)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"--metrics-port {port_spec}: cannot serve metrics there: {exc.strerror}") from None
    log.info("%s: metrics on %s:%d/metrics", replica_id, address, port)
    if targets is None:
        return None
    shown = socket.gethostname() if address in ("0.0.0.0", "::") else address
    return ScrapeTarget(targets, replica_id, role, shown, port)


def serve_service(
    service: Service,
    config: RunConfig,
    bootstrap: str | None,
    metrics: ServiceMetrics | None = None,
    stop: _StopFlag | None = None,
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
    stop = stop or _StopFlag(replica_id)
    service.observe(metrics.observe)
    given = [bus] if bus is not None else []  # the first log's bus; after a lost log, the new log's

    def bus_of() -> Bus:
        return given.pop() if given else kafka_bus(config, bootstrap)

    replica, code = Replica(service, bus_of, metrics), exit_codes.OK
    try:
        replica.start()
        log.info("%s: serving %s -> %s", replica_id, service.input_topic or "(nothing)", service.output_topic)
        _loop(replica, stop)
        if replica.ended:
            code = exit_codes.LOG_REPLACED
    except BaseException:
        code = exit_codes.ERROR  # what the process exits with if the broker's part of closing runs out of time
        raise
    finally:
        replica.stop(
            finished=code == exit_codes.OK,
            report=lambda runner, state: _report_status(runner, state),
            broker_within=lambda: _broker_deadline(replica_id, code),
        )
        if replica.runner is not None:  # one parseable line: where this replica's time went (benchmarks/ reads it)
            log.info("%s: time breakdown %s", replica_id, json.dumps({"role": role, **replica.runner.time_breakdown()}))
    if code == exit_codes.OK and replica.shortfall:
        log.error("%s: %s", replica_id, replica.shortfall)
        code = exit_codes.RUN_SHORT
    return code


@contextmanager
def _broker_deadline(replica_id: str, code: int, seconds: float = STOP_BROKER_S):
    """Exit with ``code`` if the block (the broker's part of stopping) is not done within ``seconds``: every call of
    kafka-python to a broker that is away may block for its own timeouts, several in a row."""

    def give_up() -> None:
        log.warning(
            "%s: the broker did not answer within %.0f s of stopping; exiting without it (the input not committed is "
            "delivered again)",
            replica_id,
            seconds,
        )
        os._exit(code)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _report_fleet_status(fleet: Fleet, run_id: str, state: str | None = None) -> None:
    """A fleet replica's report on one run's status topic, with the run's share of the replica."""
    name = f"{fleet.replica_id} (run {run_id})"
    _report_status(fleet.runs[run_id].runner, state, name=name, counters=fleet.status_counters(run_id))


def _report_status(
    runner: ServiceRunner,
    state: str | None = None,
    name: str | None = None,
    counters: dict | None = None,
    say: bool = True,
) -> None:
    """The status topic, and (with ``say``) the status line and, while input is held, a warning that says what it
    waits for; ``name``: who the lines are of (the replica's id by default); ``counters``: more to report."""
    name = name or runner.replica_id
    try:
        status = runner.publish_status(state, counters)
    except KafkaError as exc:  # a report is not worth failing over; the next one comes in STATUS_EVERY_S
        log.warning("%s: status not published (%s)", name, exc)
        return
    if not say:
        return
    log.info("%s: status %s", name, runner.status())
    if status.held:
        # Holding input for a while is normal (the generator waits for each update); minutes of it are worth a look.
        level = logging.WARNING if status.held_seconds >= STALL_WARNING_S else logging.INFO
        log.log(level, "%s: waiting %.0f s: %s", name, status.held_seconds, status.waiting_for)


def _loop(replica: Replica, stop: _StopFlag) -> None:
    """Step until the service is done, its log is lost for good, or a signal asks to stop; broker errors are retried
    with back-off; the status topic is told at STATUS_EVERY_S, and soon after the counters change."""
    backoff = 0.5
    next_status = time.monotonic()
    reported, reported_at = dict(replica.runner.counters), time.monotonic()
    # From here a signal cuts a wait short.
    stop.waiting = lambda: replica.runner is None or not replica.runner.processing
    try:
        while not stop.set and not replica.service.done() and not replica.ended:
            runner, now = replica.runner, time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                _report_status(runner)
                reported, reported_at = dict(runner.counters), now
            elif runner.counters != reported and now - reported_at >= STATUS_CHANGED_S:
                _report_status(runner, say=False)
                reported, reported_at = dict(runner.counters), now
            try:
                replica.step(timeout_s=0.5, go_on=not stop.set)
                backoff = 0.5
            except KafkaError as exc:
                # The batch in hand was not committed and comes back once the broker does.
                log.warning(
                    "%s: broker error (%s: %s); retrying in %.1fs", runner.replica_id, type(exc).__name__, exc, backoff
                )
                time.sleep(backoff)
                # Short: a broker that comes back (or a new one, whose log the next check finds replaced) is seen soon.
                backoff = min(backoff * 2, 4.0)
    except _Stop:
        pass
    finally:
        stop.waiting = None


def serve_fleet(
    role: str,
    runs: RunsFolder,
    shares: dict[str, float],
    bootstrap: str | None,
    replica_id: str | None = None,
    quotas: dict[str, float] | None = None,
    metrics_port: str | None = None,
    metrics_address: str = "0.0.0.0",
    metrics_targets: Path | None = None,
    rescan_s: float = RESCAN_S,
    create: Callable[[RunConfig, str], Service] | None = None,
) -> int:
    """Run one replica of ``role`` for every run whose config is in ``runs`` (:class:`~services.launch.fleet.Fleet`),
    until a signal stops it (after the turn in hand): runs are taken up and let go as their files come and go, each with
    its share (1 unless in ``shares``) and quota (none unless in ``quotas``). A run that cannot be served (its
    config, its model, its broker) is reported once, until its file changes; the others are served. Metrics, as
    :func:`serve`'s, carry a ``run`` label (:class:`~services.runtime.metrics.FleetMetrics`). ``create(config,
    replica_id)``: a run's service (the role's, by default)."""
    replica_id = replica_id or default_replica_id(role)
    stop = _StopFlag(replica_id)
    fleet = Fleet(role, lambda config: kafka_bus(config, bootstrap_of(config, bootstrap)), replica_id, create)
    metrics = FleetMetrics(
        role, lambda: {run_id: run.runner.metrics for run_id, run in list(fleet.runs.items())}, fleet.shares
    )
    target = _serve_metrics(metrics, replica_id, role, metrics_port, metrics_address, metrics_targets)
    next_scan = next_status = time.monotonic()
    try:
        while not stop.set:
            now = time.monotonic()
            if now >= next_scan:
                next_scan = now + rescan_s
                _take_runs(fleet, runs, shares, quotas or {})
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                for run_id in list(fleet.runs):
                    _report_fleet_status(fleet, run_id)
                log.info("%s: shares %s", replica_id, json.dumps(fleet.shares()))
            # A signal cuts the turns short while no run processes a record (a broker that is away can block a
            # run's turn for minutes); runs are never taken up or let go half-way.
            stop.waiting = lambda: not any(run.runner.processing for run in list(fleet.runs.values()))
            try:
                fleet.poll_once(timeout_s=0.1)
            finally:
                stop.waiting = None
    except _Stop:
        pass
    finally:
        with _broker_deadline(replica_id, exit_codes.OK, seconds=STOP_BROKER_S * max(1, len(fleet.runs))):
            fleet.close()  # each run's replica stopped: settled, its last status reported, disconnected
        if target is not None:
            target.remove()
    return exit_codes.OK


def _take_runs(fleet: Fleet, runs: RunsFolder, shares: dict[str, float], quotas: dict[str, float]) -> None:
    added, removed = runs.changes()
    for run_id in removed:
        if run_id in fleet.runs:
            fleet.remove(run_id)
    for config in added:
        try:
            fleet.add(config, shares.get(config.run.run_id, 1.0), quotas.get(config.run.run_id))
        except Exception as exc:  # a run that cannot be served (its model, its reward, its broker) stops no other
            log.warning("%s: run %s not served", fleet.replica_id, config.run.run_id, exc_info=True)
            runs.not_served(config.run.run_id, f"{type(exc).__name__}: {exc}")
    for path, error in runs.errors():
        log.error("%s: %s not served: %s", fleet.replica_id, path, error)
