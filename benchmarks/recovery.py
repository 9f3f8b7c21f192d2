"""How long the pipeline pauses when one service process is killed (``kill -9``), under ``streamppo up``.

Each trial runs ``streamppo up`` (local broker, two scorer replicas, tiny model, transformers generator), waits for
a few updates, kills one replica of a role with SIGKILL and lets ``up`` restart it. The pause is the longest gap
between two new lines of ``metrics.jsonl`` after the kill, less the median gap before it: the time the kill cost.
Trials are run with the consumer sessions Kafka brokers allow by default (6 s) and with the short ones ``up``
uses on its local broker.
"""

from __future__ import annotations

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
        args = [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--config",
            str(REPO / "examples/vowels/config.yaml"),
            "--replicas",
            "scorer=2",
            *[a for o in overrides for a in ("--set", o)],
        ]
        up = subprocess.Popen(
            args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
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
    return {
        "setup": "streamppo up, local broker, 2 scorer replicas, tiny model, transformers generator, "
        "checkpoint_every 1; kill -9 of replica 0 of the role after 10 updates; `up` restarts it after 1 s",
        "trials": rows,
    }
