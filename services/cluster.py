"""``streamppo up``: a local cluster without Docker.

Starts a local Kafka-protocol broker (unless ``--bootstrap`` names one), creates the topics, starts each service
as a child process with its output prefixed by its name, publishes the prompts, and waits for the learner to
finish. Ctrl-C (or the learner finishing) stops every child with SIGTERM, then the broker.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.process import ROLES
from services.transport.local_broker import LocalBroker

__all__ = ["parse_replicas", "up"]


def parse_replicas(specs: list[str]) -> dict[str, int]:
    """``["scorer=2"]`` -> ``{"generator": 1, "scorer": 2, ...}``."""
    replicas = {role: 1 for role in ROLES}
    for spec in specs:
        role, sep, count = spec.partition("=")
        if not sep or role not in ROLES or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--replicas {spec!r}: expected ROLE=N with ROLE one of {', '.join(ROLES)} and N ≥ 1")
        if role == "learner" and int(count) != 1:
            raise ValueError("the learner runs as a single replica")
        replicas[role] = int(count)
    return replicas


def _pump(name: str, stream) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(f"{name:>12} | {line.decode(errors='replace')}")
        sys.stdout.flush()


def up(config_path: Path, overrides: list[str], bootstrap: str | None, replicas: dict[str, int],
       verbose: bool = False) -> int:
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
        process = subprocess.Popen([sys.executable, "-m", "services.cli", *flags, *args, *common],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
        feeder = start("feed", ["feed"])
        learner = children["learner-0"]
        while not interrupted and learner.poll() is None:
            for name, process in children.items():
                if process is not feeder and process is not learner and process.poll() not in (None, 0):
                    print(f"{name} exited with code {process.returncode}; stopping", flush=True)
                    interrupted = True
            time.sleep(0.5)
        code = learner.poll()
        return 0 if code == 0 else (130 if interrupted else (code or 1))
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
