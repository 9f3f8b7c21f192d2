"""``streamppo up``: a local cluster without Docker.

Starts Apache Kafka with the run's log in the run directory (the memory broker where Java is missing; none when
``--bootstrap`` names a broker), then the replicas of every role in
``ROLES`` as child processes (``streamppo <role>``), each with its output prefixed by its name, and waits until
every replica of the roles that end the run has finished. A child that exits with an error is restarted after a
back-off (``--restart on-failure``, the default, as Kubernetes would) or stops the run (``--restart never``). When
the broker loses the run's log, each service goes on on the new one in its process; one that cannot (exit 4) is
started again in resume mode. Ctrl-C stops the run: every child gets SIGTERM (a second Ctrl-C kills them), and the
broker stops last.

It reports as ``streamppo run`` does: a line per update (from the run directory's ``metrics.jsonl``), a line when
none came for a minute, and once the run is done its ``done:`` line and ``summary.json``. It writes the run's
configuration (``config.json``) and the broker's address (``broker``) into the run directory, where ``streamppo
status --run-dir`` (and ``trace``, ``archive``) find them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kafka.errors import KafkaError

from common.config import load_config
from services.launch.embedded import clear_earlier_run
from services.roles import ROLES, roles_of
from services.runtime import exit_codes
from services.runtime.restarts import Restarts
from services.runtime.run_bus import RUN_BROKER, RUN_CONFIG, kafka_bus
from services.transport.brokers.apache_kafka import KafkaBroker
from services.transport.brokers.local_broker import LocalBroker

__all__ = ["parse_replicas", "resumed_run", "stop_all", "up"]

RUN_UP = "up.json"  # <run.dir>/up.json: how up ran the run (replicas, seconds so far), for `up --resume --run-dir`

QUIET_SAY_S = 60.0  # no update for this long: say where to look


def resumed_run(run_dir: Path) -> tuple[Path, list[str]]:
    """The config file and ``--replicas`` of the run up ran in ``run_dir``: ``up --resume --run-dir DIR`` takes the
    run up again as it ran (its settings with every --set given then, its replicas)."""
    from common.config import ConfigError

    run_dir = Path(run_dir)
    if not (run_dir / RUN_CONFIG).is_file():
        raise ConfigError(f"{run_dir} holds no {RUN_CONFIG}: is it the run directory of a run `streamppo up` ran?")
    replicas = _up_record(run_dir).get("replicas", {})
    return run_dir / RUN_CONFIG, [f"{role}={count}" for role, count in replicas.items() if count != 1]


def _up_record(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / RUN_UP).read_text())
    except (OSError, ValueError):
        return {}


def parse_replicas(specs: list[str], config=None) -> dict[str, int]:
    """``["scorer=2"]`` -> ``{"feeder": 1, "generator": 1, "scorer": 2, ...}``: every role of the run of ``config``
    (every role when None)."""
    roles = [role.name for role in roles_of(config)] if config is not None else list(ROLES)
    replicas = {role: 1 for role in roles}
    for spec in specs:
        role, sep, count = spec.partition("=")
        if not sep or role not in ROLES or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--replicas {spec!r}: expected ROLE=N with ROLE one of {', '.join(ROLES)} and N ≥ 1")
        if role not in roles:
            raise ValueError(f"--replicas {spec!r}: this run has no {role} (it needs {ROLES[role].requirement})")
        most = ROLES[role].max_replicas
        if most is not None and int(count) > most:
            raise ValueError(f"--replicas {spec!r}: the {role} runs as at most {most} replica(s)")
        replicas[role] = int(count)
    return replicas


def _pump(name: str, stream) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(f"{name:>12} | {line.decode(errors='replace')}")
        sys.stdout.flush()


LOCAL_SESSION_TIMEOUT_MS, LOCAL_HEARTBEAT_MS = 1000, 250  # consumer sessions on the local broker
RESUME = ["--set", "run.resume=true"]


@dataclass
class _Child:
    name: str
    args: list[str]
    process: subprocess.Popen | None = None
    started: float = 0.0
    restarts: Restarts = field(default_factory=Restarts)
    restart_at: float | None = None  # when a restart is due
    env: dict[str, str] | None = None


class _Members:
    """Tells the run's consumer groups of a replica that died, the moment ``up`` sees it exit
    (:meth:`~services.transport.base.Bus.remove_member`): the others take its partitions now, not after its session
    timeout, and the replica started again joins as itself."""

    def __init__(self, config, bootstrap: str):
        self.config, self.bootstrap, self.bus = config, bootstrap, None

    def remove(self, name: str) -> None:
        try:
            if self.bus is None:
                self.bus = kafka_bus(self.config, self.bootstrap, make=False)
            groups = self.bus.remove_member(name)
        except (KafkaError, OSError, ValueError) as exc:  # BrokerUnavailable is an OSError; ValueError: an answer
            # kafka-python cannot parse. The removal only saves time: the session timeout still frees the partitions.
            print(f"{name} not removed from its consumer groups ({exc}): they wait for its session", flush=True)
            return
        if groups:
            print(f"{name} removed from its consumer group ({', '.join(groups)}): its partitions move now", flush=True)

    def close(self) -> None:
        if self.bus is not None:
            self.bus.close()


class _Updates:
    """What ``up`` says of training as it goes: a line per update the learner writes to ``metrics.jsonl`` (those
    after ``up`` started), and one when none came for a minute."""

    def __init__(self, metrics: Path, steps: int, status_command: str):
        from common.statistics import progress_labels

        self.metrics, self.steps, self.status_command = metrics, steps, status_command
        self.labels = progress_labels()
        self.offset = metrics.stat().st_size if metrics.exists() else 0
        self.started = self.last = time.monotonic()
        self.updated = False  # an update came since up started

    def poll(self) -> None:
        now = time.monotonic()
        for record in self._new_records():
            self.last, self.updated = now, True
            shown = ", ".join(f"{label} {record[key]:.4g}" for label, key in self.labels.items() if key in record)
            print(f"update {record['step']}/{self.steps} ({now - self.started:.0f} s): {shown}", flush=True)
        if now - self.last >= QUIET_SAY_S:
            self.last = now
            if self.updated:
                print(
                    f"no update for {QUIET_SAY_S:.0f} s; what each replica waits for: {self.status_command}", flush=True
                )
            else:  # the services load their models and the engine starts first: minutes on a few cores, not a stall
                print(
                    f"no update yet after {now - self.started:.0f} s (the services load their models first); what each "
                    f"replica does: {self.status_command}",
                    flush=True,
                )

    def _new_records(self) -> list[dict]:
        if not self.metrics.exists():
            return []
        with open(self.metrics) as fh:
            fh.seek(self.offset)
            text = fh.read()
        complete = text[: text.rfind("\n") + 1]  # a line being written is read next time
        self.offset += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


def up(
    config_path: Path,
    overrides: list[str],
    bootstrap: str | None,
    replicas: dict[str, int],
    verbose: bool = False,
    restart: str = "on-failure",
    config=None,
    broker: str = "kafka",
) -> int:
    """Run the pipeline; returns 0 once every replica of the roles that end the run has finished.

    With ``restart="on-failure"`` a child that exits with an error (or is killed) is restarted after a back-off, as
    :mod:`services.runtime.restarts` says; when it gives up, the run stops with that child's exit code. With
    ``restart="never"`` the first failure stops the run. ``config``: the run's configuration (``config_path`` with
    ``overrides``), for what ``up`` reports. ``broker``: which to start when ``bootstrap`` names none (``kafka``,
    or ``memory``).
    """
    which, broker = broker, None
    started, before = time.time(), 0.0  # before: the seconds of the run's earlier ups (a resumed run's)
    if bootstrap is None:
        broker, said = _start_broker(config, which)
        bootstrap = broker.bootstrap
        # Short consumer sessions (Apache Kafka's group.min.session.timeout.ms is 6 s by default; the broker up starts
        # allows 1 s): a killed replica's partitions move to the others in under 3 s instead of 10
        # (benchmarks/RESULTS.md). The memory broker rejects kafka-python's idempotent produce (no producer id);
        # re-delivery is still harmless there, as every consumer de-duplicates by batch id.
        overrides = [
            *(
                ["kafka.idempotent_producer=false", "kafka.static_members=false"]
                if isinstance(broker, LocalBroker)
                else []
            ),
            f"kafka.session_timeout_ms={LOCAL_SESSION_TIMEOUT_MS}",
            f"kafka.heartbeat_interval_ms={LOCAL_HEARTBEAT_MS}",
            *overrides,  # the user's settings win
        ]
        print(said, flush=True)
    # Signed by default with a key made for the run (pipeline.run_key), unless the user chose a key or chose none.
    pipeline = config.pipeline if config is not None else None
    keyed = pipeline is not None and (pipeline.signing_key_env or pipeline.signing_key_file)
    if pipeline is not None and not keyed and "run_key" in pipeline.model_fields_set and not pipeline.run_key:
        print("messages UNSIGNED (pipeline.run_key=false): any client of the broker can forge the run's records")
    elif keyed:
        print("messages signed with the configured key")
    else:
        overrides = ["pipeline.run_key=true", *overrides]
        print("messages signed with a key made for the run (pipeline.run_key; in its run directory)")
    common = ["--config", str(config_path), "--bootstrap", bootstrap]
    common += [arg for override in overrides for arg in ("--set", override)]
    updates, members = None, None
    if config is not None:
        run_dir = Path(config.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        cleared = None if config.run.resume else clear_earlier_run(config)
        if cleared:  # its learner would take up the checkpoint and report the earlier run as this one
            print(f"{cleared}; `up --resume --run-dir {run_dir}` goes on from an earlier run instead", flush=True)
        # What the children run with, up's own settings included (the run's key, the sessions): a replica added by
        # hand (`streamppo scorer --config <run dir>/config.json`) is then one of the run.
        children_config = load_config(config_path, overrides)
        (run_dir / RUN_CONFIG).write_text(children_config.model_dump_json(indent=2, exclude_unset=True))
        (run_dir / RUN_BROKER).write_text(bootstrap + "\n")
        updates = _Updates(run_dir / "metrics.jsonl", config.run.steps, f"streamppo status --run-dir {run_dir}")
        members = _Members(children_config, bootstrap)
        before = _up_record(run_dir).get("seconds", 0.0) if config.run.resume else 0.0
        (run_dir / RUN_UP).write_text(json.dumps({"replicas": replicas, "seconds": before}))
    flags = ["-v"] if verbose else []
    env = child_environment(sum(replicas.values()))
    children = {
        f"{role}-{i}": _Child(f"{role}-{i}", [*flags, role, "--replica-id", f"{role}-{i}", *common], env=env)
        for role in replicas
        for i in range(replicas[role])
    }
    ending = [children[f"{role}-{i}"] for role in replicas if ROLES[role].ends_run for i in range(replicas[role])]
    # The topics first, replacing a weights topic that a new, empty broker made on its own.
    topics = subprocess.run([sys.executable, "-m", "services.cli", *flags, "topics", *common])
    if topics.returncode != 0:
        if broker is not None:
            broker.stop()
        return topics.returncode

    signals = 0

    def on_signal(signum, frame):
        nonlocal signals
        signals += 1
        if signals == 2:
            print("stopping now: every service is killed (a batch in hand is delivered again)", flush=True)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for child in children.values():
            _spawn(child)
        while not signals:
            replaced = [child.name for child in children.values() if _found_the_log_replaced(child)]
            if replaced:
                _resume_on_the_new_log(children, replaced)
                continue
            for child in children.values():
                code = _supervise(child, restart, members)
                if code is not None:
                    return code
            if updates is not None:
                updates.poll()
            ended = {child.process.poll() for child in ending}
            if ended <= {exit_codes.OK, exit_codes.RUN_SHORT}:  # every one finished, short of run.steps or not
                if updates is not None:
                    updates.poll()
                    _summarise(config, bootstrap, before + time.time() - started)  # every up of the run
                return exit_codes.RUN_SHORT if exit_codes.RUN_SHORT in ended else exit_codes.OK
            time.sleep(0.2)  # how soon a replica's death is seen (and told to its groups)
        return exit_codes.INTERRUPTED
    finally:
        if signals:
            print("stopping every service (Ctrl-C again to kill them at once)", flush=True)
        stop_all([child.process for child in children.values() if child.process is not None], hurry=lambda: signals > 1)
        if members is not None:
            members.close()
        if broker is not None:
            broker.stop()
        if config is not None:
            run_dir = Path(config.run.dir)
            (run_dir / RUN_UP).write_text(json.dumps({"replicas": replicas, "seconds": before + time.time() - started}))
            if signals:
                metrics = run_dir / "metrics.jsonl"
                done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
                print(
                    f"stopped after update {done} of {config.run.steps}; resume with "
                    f"`streamppo up --resume --run-dir {run_dir}`",
                    flush=True,
                )


def _start_broker(config, which: str = "kafka") -> tuple[KafkaBroker | LocalBroker, str]:
    """The run's broker, and the line that says which: Apache Kafka with its log in the run directory (``kafka/``),
    where Java is; the memory broker otherwise, saying why. A new run starts on an empty log; ``run.resume`` takes
    up the one there (on the port it had, where that is free), as after a machine's restart."""
    from services.transport.brokers.apache_kafka import KAFKA_VERSION, KafkaBroker, KafkaUnavailable, kafka_available

    why = kafka_available() if which == "kafka" else "--broker memory"
    if why is None and config is not None:
        run_dir = Path(config.run.dir)
        folder = run_dir / "kafka"
        port = None
        if config.run.resume:
            port = _free_port_of(run_dir / RUN_BROKER)
        elif folder.exists():
            shutil.rmtree(folder)  # a new run: the log of the one before it in this folder is not its own
        try:
            broker = KafkaBroker(folder, port).start()
        except KafkaUnavailable as exc:
            why = str(exc)
        else:
            kept = "taken up again" if config.run.resume and broker.formatted else "new"
            return broker, (
                f"Apache Kafka {KAFKA_VERSION} serving on {broker.bootstrap}: the run's log ({kept}) in {folder}, "
                f"kept across the broker's restarts; its own log in {broker.log_path}"
            )
    broker = LocalBroker().start()
    why = why or "no run directory given"
    because = "as asked (--broker memory)" if which == "memory" else f"because Apache Kafka cannot run here ({why})"
    return broker, (
        f"the memory broker serving on {broker.bootstrap}, {because}: the run's log is lost when it stops, and the "
        "idempotent producer is off"
    )


def _free_port_of(address_file: Path) -> int | None:
    """The port of the address a run's broker had (``<run.dir>/broker``), if it is free now."""
    try:
        port = int(address_file.read_text().strip().rpartition(":")[2])
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
        return port
    except (OSError, ValueError):
        return None


def _summarise(config, bootstrap: str, seconds: float):
    """The run's ``done:`` line and ``summary.json``, its dead letters counted from the broker's topics."""
    from services.ops.status import read_status
    from services.ops.summary import summarise_run
    from services.runtime.run_bus import kafka_bus

    try:
        bus = kafka_bus(config, bootstrap, make=False)
        try:
            dead_letters = sum(read_status(bus, config.run.run_id).dead_letters.values())
        finally:
            bus.close()
    except Exception as exc:  # the summary is still worth having; say why the count is missing
        print(f"dead letters not counted: {type(exc).__name__}: {exc}", flush=True)
        dead_letters = -1
    summary = summarise_run(Path(config.run.dir), dead_letters, config.run.steps, wall_seconds=seconds)
    print(summary.done_line(), flush=True)
    return summary


def stop_all(processes: list[subprocess.Popen], timeout_s: float = 60.0, hurry=lambda: False) -> None:
    """SIGTERM to every process still running (each finishes its batch in hand), then wait; kill what outlives
    ``timeout_s``, or everything once ``hurry()`` says so (a second Ctrl-C)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + timeout_s
    while any(process.poll() is None for process in processes) and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def child_environment(children: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: the machine's cores shared out among them, unless the user chose.

    Each torch process otherwise runs one thread per core, so N services on one machine run N × cores threads
    that preempt each other mid-step: a restarted scorer loading its models made the learner's update many times
    slower (benchmarks/RESULTS.md, section 7). torchrun does the same for its ranks.
    """
    environ = dict(os.environ if environ is None else environ)
    share = max(1, (os.cpu_count() or 1) // max(children, 1))
    return {"OMP_NUM_THREADS": str(share)} | environ  # the user's setting wins


def _spawn(child: _Child) -> None:
    child.process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *child.args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child.env,
    )
    child.started, child.restart_at = time.monotonic(), None
    threading.Thread(target=_pump, args=(child.name, child.process.stdout), daemon=True).start()


def _found_the_log_replaced(child: _Child) -> bool:
    return child.restart_at is None and child.process is not None and child.process.poll() == exit_codes.LOG_REPLACED


def _resume_on_the_new_log(children: dict[str, _Child], found_by: list[str]) -> None:
    """The broker lost the run's log and the services of ``found_by`` could not go on on the new one in their process
    (the others do, :meth:`~services.service.Service.take_up_new_log`): start each again in resume mode, as an
    operator would with ``<role> --resume``. It makes the topics of the new log itself if it is the first there."""
    print(
        f"{', '.join(found_by)} found the run's log gone (the broker lost its data); starting "
        f"{'it' if len(found_by) == 1 else 'them'} again in resume mode on the new log",
        flush=True,
    )
    for name in found_by:
        child = children[name]
        if RESUME[1] not in child.args:
            child.args += RESUME
        child.restarts = Restarts()
        _spawn(child)


def _supervise(child: _Child, restart: str, members: _Members | None = None) -> int | None:
    """Restart ``child`` when it failed and its back-off is over; the exit code that stops the run, or None. A child
    that failed is first removed from its consumer groups (``members``)."""
    now = time.monotonic()
    if child.restart_at is not None:
        if now >= child.restart_at:
            _spawn(child)
        return None
    code = child.process.poll()
    if code is None or code in (exit_codes.OK, exit_codes.RUN_SHORT):  # running, or finished (the learner short)
        return None
    failed = code if code > 0 else 1  # killed by a signal
    if members is not None:
        members.remove(child.name)
    if restart == "never" or code in exit_codes.PERMANENT:
        why = exit_codes.PERMANENT.get(code)
        print(f"{child.name} exited with code {code}{f' ({why})' if why else ''}; stopping", flush=True)
        return failed
    delay = child.restarts.after_exit(code, now - child.started)
    if delay is None:
        policy = child.restarts.policy
        print(
            f"{child.name} failed {child.restarts.quick_failures} times in a row, each within "
            f"{policy.quick_failure_s:.0f} s of its start (last exit code {code}); stopping",
            flush=True,
        )
        return failed
    print(f"{child.name} exited with code {code}; restarting it in {delay} s", flush=True)
    child.restart_at = now + delay
    return None
