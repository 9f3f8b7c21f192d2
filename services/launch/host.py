"""What every host of replicas shares, a process of one replica (:mod:`.process`) or a fleet's of several runs
(:mod:`.fleet`): its name, its signals, its metrics endpoint, its status reports, the bound on the broker's part of
stopping, and the one loop that drives it.

The loop (:func:`host_loop`), in each turn: what is due on time (status reports; a fleet's rescan of its runs), then
one step of the hosted replicas. A broker error is retried with back-off; SIGTERM or SIGINT stops it after the batch
in hand, or at once while it only waits (for input, for a broker that is away).
"""

from __future__ import annotations

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
from typing import Protocol

from kafka.errors import KafkaError

from common.config import ConfigError
from common.schema import REPORT_EVERY_S
from services.runtime import ServiceRunner
from services.runtime.metrics import FleetMetrics, ScrapeTarget, ServiceMetrics, parse_ports

log = logging.getLogger(__name__)

__all__ = [
    "STATUS_EVERY_S",
    "STOP_BROKER_S",
    "Hosted",
    "StatusCadence",
    "StopFlag",
    "broker_deadline",
    "default_replica_id",
    "host_loop",
    "report_status",
    "serve_metrics",
]

STATUS_EVERY_S = REPORT_EVERY_S
# The status topic is also told within this of a change of the counters, so that status and wait are never a
# cadence behind what a replica did; the log line stays at STATUS_EVERY_S.
STATUS_CHANGED_S = 2.0
STALL_WARNING_S = 120.0
STOP_BROKER_S = 5.0  # what a stopping replica waits for the broker, at most
BACKOFF_S = (0.5, 4.0)  # a broker error's first wait before the next step, and the longest (doubled in between)


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
    """Raised by a signal into a host that is only waiting: nothing of a batch is in hand."""


class StopFlag:
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


class Hosted(Protocol):
    """What a host loop drives: one replica, or a fleet's."""

    name: str

    def done(self) -> bool:
        """Whether the hosted work is over (the service done, its log lost for good); a fleet's never is."""

    def busy(self) -> bool:
        """Whether a batch is in hand now: a signal then waits for it."""

    def on_time(self, now: float) -> None:
        """What is due at ``now`` (status reports, a fleet's rescan)."""

    def step(self, go_on: bool) -> None:
        """One step; ``go_on`` False: a stop was asked for (a replica on a lost log ends there). May raise
        :class:`KafkaError`, retried with back-off."""


def host_loop(hosted: Hosted, stop: StopFlag) -> None:
    """Drive ``hosted`` until it is done or a signal asks to stop (see the module's docstring)."""
    backoff = BACKOFF_S[0]
    stop.waiting = lambda: not hosted.busy()  # from here a signal cuts a wait short
    try:
        while not stop.set and not hosted.done():
            hosted.on_time(time.monotonic())
            try:
                hosted.step(go_on=not stop.set)
                backoff = BACKOFF_S[0]
            except KafkaError as exc:
                # The batch in hand was not committed and comes back once the broker does.
                name, kind = hosted.name, type(exc).__name__
                log.warning("%s: broker error (%s: %s); retrying in %.1fs", name, kind, exc, backoff)
                time.sleep(backoff)
                # Short: a broker that comes back (or a new one, whose log the next check finds replaced) is seen soon.
                backoff = min(backoff * 2, BACKOFF_S[1])
    except _Stop:
        pass
    finally:
        stop.waiting = None


class StatusCadence:
    """When one replica's status is told: in full (the topic and the log's status line) every STATUS_EVERY_S, and
    on the topic alone within STATUS_CHANGED_S of a change of its counters. ``report(runner, say)`` tells it."""

    def __init__(self, report: Callable[[ServiceRunner, bool], None]):
        self.report = report
        self.next_full = time.monotonic()
        self.reported: dict | None = None
        self.reported_at = time.monotonic()

    def tell(self, runner: ServiceRunner, now: float) -> None:
        if self.reported is None:
            self.reported = dict(runner.counters)
        if now >= self.next_full:
            self.next_full = now + STATUS_EVERY_S
            self.report(runner, True)
        elif runner.counters != self.reported and now - self.reported_at >= STATUS_CHANGED_S:
            self.report(runner, False)
        else:
            return
        self.reported, self.reported_at = dict(runner.counters), now


def report_status(
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


@contextmanager
def broker_deadline(replica_id: str, code: int, seconds: float = STOP_BROKER_S):
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


def serve_metrics(
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
