"""``streamppo up``: a local cluster without Docker.

Starts a local Kafka-protocol broker (unless ``--bootstrap`` names one), then the replicas of every role in
``ROLES`` as child processes (``streamppo <role>``), each with its output prefixed by its name, and waits until
every replica of the roles that end the run has finished. A child that exits with an error, or Ctrl-C, stops the
run; then every child gets SIGTERM, and the broker stops last.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.roles import ROLES
from services.transport.local_broker import LocalBroker

__all__ = ["parse_replicas", "up"]


def parse_replicas(specs: list[str]) -> dict[str, int]:
    """``["scorer=2"]`` -> ``{"feeder": 1, "generator": 1, "scorer": 2, ...}``."""
    replicas = {role: 1 for role in ROLES}
    for spec in specs:
        role, sep, count = spec.partition("=")
        if not sep or role not in ROLES or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--replicas {spec!r}: expected ROLE=N with ROLE one of {', '.join(ROLES)} and N ≥ 1")
        most = ROLES[role].max_replicas
        if most is not None and int(count) > most:
            raise ValueError(f"--replicas {spec!r}: the {role} runs as at most {most} replica(s)")
        replicas[role] = int(count)
    return replicas


def _pump(name: str, stream) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(f"{name:>12} | {line.decode(errors='replace')}")
        sys.stdout.flush()


def up(
    config_path: Path, overrides: list[str], bootstrap: str | None, replicas: dict[str, int], verbose: bool = False
) -> int:
    broker = None
    if bootstrap is None:
        broker = LocalBroker().start()
        bootstrap = broker.bootstrap
        # kafka-python's idempotent producer cannot initialise against this broker (it rejects the produce with
        # no producer id); re-delivery is still harmless, as every consumer de-duplicates by batch id.
        overrides = [*overrides, "kafka.idempotent_producer=false"]
        print(f"local broker listening on {bootstrap} (memory storage; idempotent producer off)", flush=True)
    common = ["--config", str(config_path), "--bootstrap", bootstrap]
    common += [arg for override in overrides for arg in ("--set", override)]
    children: dict[str, subprocess.Popen] = {}

    def start(name: str, args: list[str]) -> subprocess.Popen:
        flags = ["-v"] if verbose else []
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *flags, *args, *common],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        threading.Thread(target=_pump, args=(name, process.stdout), daemon=True).start()
        children[name] = process
        return process

    interrupted = False

    def on_signal(signum, frame):
        nonlocal interrupted
        interrupted = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for role in ROLES:
            for index in range(replicas[role]):
                name = f"{role}-{index}"
                start(name, [role, "--replica-id", name])
        ending = [children[f"{role}-{i}"] for role in ROLES if ROLES[role].ends_run for i in range(replicas[role])]
        while not interrupted:
            crashed = [(name, process) for name, process in children.items() if process.poll() not in (None, 0)]
            if crashed:
                name, process = crashed[0]
                print(f"{name} exited with code {process.returncode}; stopping", flush=True)
                return process.returncode if process.returncode > 0 else 1
            if all(process.poll() == 0 for process in ending):
                return 0
            time.sleep(0.5)
        return 130
    finally:
        for process in children.values():
            if process.poll() is None:
                process.terminate()
        for process in children.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        if broker is not None:
            broker.stop()
