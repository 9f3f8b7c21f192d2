"""A fleet: one replica of a role serving several runs at once (``streamppo fleet ROLE --runs DIR``).

Each run keeps everything that makes its delivery exact. The fleet holds a :class:`~services.runtime.ServiceRunner`
per run, on that run's bus (its namespace, its log, the role's consumer group there, its signing key), around a
service of its own (its bound on staleness, its memory of what it handled, its reward): a record of one run is never
read, counted or committed by another's runner, and a run's resume or lost log touches only its runner. What the runs
share is the replica: its process, its cores, and the turns it gives them.

Turns are fair by share: the run whose compute so far, divided by its share, is the least goes first (start-time fair
queueing over the seconds each ``poll_once`` worked), so a run that floods its input gets its share of the replica
while the others have work, and all of it when they have none. A run that had nothing to do banks no credit: it
comes back level with the runs that worked meanwhile. Runs come and go with their config files in the runs folder;
the others go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kafka.errors import KafkaError

from common.config import ConfigError, RunConfig, load_config
from services.metrics import ServiceMetrics
from services.roles import ROLES
from services.runtime import ServiceRunner
from services.transport import Bus, LogReplaced

log = logging.getLogger(__name__)

__all__ = ["Fleet", "RunsFolder", "parse_shares"]

BROKER_BACKOFF_S = 2.0  # a run whose broker errs waits this long before its next turn; the others go on


@dataclass
class _Run:
    config: RunConfig
    share: float
    runner: ServiceRunner
    virtual: float = 0.0  # compute seconds / share so far: the least goes first
    seconds: float = 0.0  # compute seconds so far
    resume_at: float = 0.0  # after a broker error (time.monotonic())


class Fleet:
    """The runners of one role's replica, one per run. ``bus_of(config)``: the bus of a run (its namespace on the
    broker); ``replica_id``: this replica's name in every run it serves."""

    def __init__(self, role: str, bus_of: Callable[[RunConfig], Bus], replica_id: str | None = None):
        if ROLES[role].ends_run or ROLES[role].input_topic is None:
            raise ValueError(f"a fleet serves a role with input that serves until stopped, not the {role}")
        self.role, self.bus_of = role, bus_of
        self.replica_id = replica_id or f"{role}-fleet"
        self.runs: dict[str, _Run] = {}
        self.clock = 0.0  # the virtual time of the last run that worked

    def add(self, config: RunConfig, share: float = 1.0) -> None:
        """Serve ``config``'s run from now on, with ``share`` of the replica against the others' shares."""
        run_id = config.run.run_id
        if run_id in self.runs:
            raise ValueError(f"the fleet serves run {run_id} already")
        if not share > 0:
            raise ValueError(f"run {run_id}: a share must be above 0, not {share}")
        service = ROLES[self.role].create(config, self.replica_id)
        metrics = ServiceMetrics(self.role)  # the run's own
        service.observe(metrics.observe)
        try:
            runner = ServiceRunner(service, self.bus_of(config), metrics=metrics)
        except BaseException:
            service.close()
            raise
        self.runs[run_id] = _Run(config, share, runner, virtual=self.clock)
        log.info("%s: serving run %s (share %g)", self.replica_id, run_id, share)

    def remove(self, run_id: str) -> None:
        """Stop serving a run: its state made durable and its input committed as far as it was handled."""
        run = self.runs.pop(run_id)
        run.runner.close()
        log.info("%s: no longer serving run %s", self.replica_id, run_id)

    def poll_once(self, timeout_s: float = 0.0) -> bool:
        """One turn: the runs in order of their compute over share, each asked to do one step until one does.
        Returns whether any did; if none did, waits ``timeout_s`` first."""
        now = time.monotonic()
        for run in sorted(self.runs.values(), key=lambda run: run.virtual):
            if now < run.resume_at:
                continue
            started = time.perf_counter()
            did = self._step(run)
            if did:
                spent = time.perf_counter() - started
                self.clock = max(self.clock, run.virtual)
                run.virtual += spent / run.share
                run.seconds += spent
                return True
            run.virtual = max(run.virtual, self.clock)  # idle time is no credit
        time.sleep(timeout_s)
        return False

    def _step(self, run: _Run) -> bool:
        try:
            return run.runner.poll_once(0.0)
        except LogReplaced as exc:
            self._take_up_new_log(run, exc)
            return True
        except KafkaError as exc:  # this run's broker; its batch in hand comes back once the broker does
            log.warning(
                "%s: run %s: broker error (%s); its next turn in %.0f s",
                self.replica_id,
                run.config.run.run_id,
                exc,
                BROKER_BACKOFF_S,
            )
            run.resume_at = time.monotonic() + BROKER_BACKOFF_S
            return False

    def _take_up_new_log(self, run: _Run, exc: LogReplaced) -> None:
        """As a replica of one run does (services/process.py): go on on the new log with the service kept, or stop
        serving the run if the service cannot."""
        run_id = run.config.run.run_id
        if not run.runner.leave_for_new_log(exc):
            run.runner.service.close()
            del self.runs[run_id]
            log.error("%s: run %s is no longer served by this fleet replica", self.replica_id, run_id)
            return
        run.runner = ServiceRunner(run.runner.service, self.bus_of(run.config), metrics=run.runner.metrics)

    def shares(self) -> dict[str, dict]:
        """Per run: its share, the fraction of the shares, the compute seconds it used and their fraction."""
        total_share = sum(run.share for run in self.runs.values()) or 1.0
        total_seconds = sum(run.seconds for run in self.runs.values()) or 1.0
        return {
            run_id: {
                "share": run.share,
                "share_fraction": round(run.share / total_share, 4),
                "seconds": round(run.seconds, 3),
                "seconds_fraction": round(run.seconds / total_seconds, 4),
            }
            for run_id, run in self.runs.items()
        }

    def close(self) -> None:
        for run_id in list(self.runs):
            self.remove(run_id)


class RunsFolder:
    """The runs a fleet serves: one config file (``*.yaml``) per run in a folder, each with ``overrides`` applied. A
    file added is a run to serve; a file removed, a run to stop serving. A file that does not load, or whose run
    cannot be served, is tried again once it changes."""

    def __init__(self, folder: Path, overrides: list[str] | None = None):
        self.folder, self.overrides = Path(folder), list(overrides or [])
        self.files: dict[Path, str] = {}  # file -> its run id
        self.failed: dict[Path, float] = {}  # file -> its modification time when it failed to load
        self.unreported: list[tuple[Path, str]] = []

    def changes(self) -> tuple[list[RunConfig], list[str]]:
        """The runs added since the last call, and the ids of the runs removed."""
        present = set(self.folder.glob("*.yaml"))
        added = []
        for path in sorted(present - set(self.files)):
            changed = path.stat().st_mtime
            if self.failed.get(path) == changed:
                continue
            try:
                config = load_config(path, self.overrides)
            except ConfigError as exc:
                self.failed[path] = changed
                self.unreported.append((path, str(exc)))
                continue
            self.failed.pop(path, None)
            self.files[path] = config.run.run_id
            added.append(config)
        removed = [self.files.pop(path) for path in sorted(set(self.files) - present)]
        return added, removed

    def not_served(self, run_id: str, error: str) -> None:
        """The run of ``run_id`` loaded but could not be served: its file is tried again once it changes."""
        for path, served in list(self.files.items()):
            if served == run_id:
                del self.files[path]
                self.failed[path] = path.stat().st_mtime if path.exists() else 0.0
                self.unreported.append((path, error))

    def errors(self) -> list[tuple[Path, str]]:
        """The files that failed to load since the last call, and why."""
        errors, self.unreported = self.unreported, []
        return errors


def parse_shares(specs: list[str]) -> dict[str, float]:
    """``["run-a=3"]`` -> ``{"run-a": 3.0}``: each run's share (1 unless given)."""
    shares = {}
    for spec in specs:
        run_id, sep, value = spec.partition("=")
        try:
            share = float(value)
        except ValueError:
            share = 0.0
        if not sep or not run_id or not share > 0:
            raise ValueError(f"--share {spec!r}: expected RUN_ID=WEIGHT with a weight above 0")
        shares[run_id] = share
    return shares
