"""How long the pipeline pauses when one service process is killed (``kill -9``), under ``streamppo up``.

Each trial runs ``streamppo up`` (local broker, two scorer replicas, tiny model, transformers generator), waits for
a few updates, kills one replica of a role with SIGKILL and lets ``up`` restart it. The pause is the longest gap
between two new lines of ``metrics.jsonl`` after the kill, less the median gap before it: the time the kill cost.
Trials are run with the consumer sessions Kafka brokers allow by default (6 s) and with the short ones ``up``
uses on its local broker.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SESSIONS = {"6 s sessions (Kafka's default minimum)": (6000, 1000), "1 s sessions (streamppo up)": (1000, 250)}


def _start_up(overrides: list[str], *extra: str) -> subprocess.Popen:
    """`streamppo up` on the example, quiet, in a session of its own (so that its services can be killed with it)."""
    args = [sys.executable, "-m", "services.cli", "up", "--config", str(REPO / "examples/vowels/config.yaml"), *extra]
    args += [a for o in overrides for a in ("--set", o)]
    return subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def stall_after_kill(role: str, session_ms: int, heartbeat_ms: int, steps: int = 30, kill_after: int = 10) -> dict:
    run_id = f"rec{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        overrides = [
            f"run.steps={steps}",
            f"run.dir={tmp}/run",
            f"run.run_id={run_id}",
            "generation.backend=transformers",
            f"kafka.session_timeout_ms={session_ms}",
            f"kafka.heartbeat_interval_ms={heartbeat_ms}",
        ]
        up = _start_up(overrides, "--replicas", "scorer=2")
        seen, killed_at, deadline = [], None, time.monotonic() + 600
        try:
            while up.poll() is None and time.monotonic() < deadline:
                lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
                seen += [time.monotonic()] * (lines - len(seen))
                if killed_at is None and lines >= kill_after:
                    subprocess.run(["pkill", "-9", "-f", f"replica-id {role}-0 .*run.run_id={run_id}"], check=True)
                    killed_at = time.monotonic()
                time.sleep(0.02)
        finally:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGTERM)
                up.wait(timeout=120)
    before = [b - a for a, b in zip(seen[: kill_after - 1], seen[1:kill_after])]
    after = [b - a for a, b in zip(seen[kill_after - 1 :], seen[kill_after:])]
    return {
        "role": role,
        "updates": len(seen),
        "median_gap_s": statistics.median(before),
        "longest_gap_after_kill_s": max(after),
        "stall_s": max(after) - statistics.median(before),
    }


def bench_recovery() -> dict:
    rows = []
    for label, (session_ms, heartbeat_ms) in SESSIONS.items():
        for role in ("scorer", "generator", "learner"):
            print(f"[recovery] {label}: kill -9 {role}-0", file=sys.stderr, flush=True)
            rows.append({"sessions": label, **stall_after_kill(role, session_ms, heartbeat_ms)})
    print("[recovery] broker loss, then up --resume on a new broker", file=sys.stderr, flush=True)
    return {
        "broker_loss": resume_after_broker_loss(),
        "setup": "streamppo up, local broker, 2 scorer replicas, tiny model, transformers generator, "
        "checkpoint_every 1; kill -9 of replica 0 of the role after 10 updates; `up` restarts it after 1 s",
        "trials": rows,
    }


def resume_after_broker_loss(steps: int = 30, lost_after: int = 10) -> dict:
    """Seconds from `streamppo up --resume` on a new, empty broker to the first update after the checkpoint."""
    from services.transport.brokers.local_broker import LocalBroker, free_port

    port, run_id = free_port(), f"loss{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        overrides = [
            f"run.steps={steps}",
            f"run.dir={tmp}/run",
            f"run.run_id={run_id}",
            "generation.backend=transformers",
            "kafka.idempotent_producer=false",
        ]

        def up(*extra):
            return _start_up(overrides, "--bootstrap", f"127.0.0.1:{port}", *extra)

        def lines() -> int:
            return len(metrics.read_text().splitlines()) if metrics.exists() else 0

        broker = LocalBroker(port).start()
        first = up()
        while lines() < lost_after:
            time.sleep(0.05)
        broker.stop()
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=300)
        checkpointed = lines()
        broker = LocalBroker(port).start()
        started = time.monotonic()
        second = up("--resume")
        while lines() <= checkpointed and second.poll() is None:
            time.sleep(0.05)
        to_first_update = time.monotonic() - started
        code = second.wait(timeout=900)
        broker.stop()
        applied = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    return {
        "checkpoint_at": checkpointed,
        "seconds_to_first_update_after_resume": to_first_update,
        "exit_code": code,
        "every_version_once": applied == list(range(1, steps + 1)),
    }
