"""How long the pipeline pauses when one service process is killed (``kill -9``) or stopped (SIGSTOP), under
``streamppo up`` on Apache Kafka, with the Kafka client settings the project had before kafka-python 3 and those it
has now, side by side in one run.

Each trial runs ``streamppo -v up`` (Apache Kafka started by ``up``, tiny model, transformers generator, 6 s consumer
sessions: Apache Kafka's least by default), waits for a number of updates, causes its fault to replica 0 of a role,
and lets ``up`` restart it. Per trial: the time from the fault to the next update (``metrics.jsonl`` gains a line),
the longest gap between updates after the fault less the median gap before it (the pause), for a restarted
replica the seconds from its restart to its "serving" line (its start time), the groups dropped as too stale, and
whether every version and every group was trained once.

The broker faults run on a cluster of three brokers of the trial's own (replication 3, min.insync.replicas 2),
the run under ``up --bootstrap``: the experience partitions' leader killed, the active controller killed (each
started again 20 s later), the leader stopped for 20 s (SIGSTOP: silent, with its connections open, as a host that
lost its network is).

The two settings:

- before: the clients as at 1ea791d (under kafka-python 2.3.3), on kafka-python 3: dynamic members (a death is
  learned from the session timeout), kafka-python's 30 s request timeout and reconnect backoff, 5 min metadata
  age; and for the broker faults Kafka's default fencing (9 s broker sessions, 30 s replica lag);
- now: static members that ``up`` removes from their groups the moment it sees them exit, 5 s requests, 1 s
  reconnect backoff, 3 s metadata age; brokers as ``deploy/contract.yaml`` sets them (3 s sessions, 6 s lag).
  Both run today's ``up``, which restarts a failed replica at once the first time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SESSION = ("kafka.session_timeout_ms=6000", "kafka.heartbeat_interval_ms=1000")
SETTINGS = {
    "before": (
        "kafka.static_members=false",
        "kafka.request_timeout_ms=30000",
        "kafka.reconnect_backoff_max_ms=30000",
        "kafka.metadata_max_age_ms=300000",
    ),
    "now": (),
}
# (role, its replicas, the fault): kill -9, or SIGSTOP for 20 s then SIGCONT
FAULTS = (
    ("scorer", 2, "kill"),
    ("scorer", 1, "kill"),
    ("generator", 2, "kill"),
    ("generator", 1, "kill"),
    ("learner", 1, "kill"),
    ("scorer", 2, "stop"),
)
STOPPED_S = 20.0
# The brokers' fencing before deploy/contract.yaml set it (Kafka's defaults), for the broker faults' "before".
BROKER_BEFORE = {
    "broker.heartbeat.interval.ms": "2000",
    "broker.session.timeout.ms": "9000",
    "replica.lag.time.max.ms": "30000",
}
# On a cluster of three brokers (replication 3, min.insync 2): the experience partitions' leader killed, the active
# controller killed, the leader stopped (SIGSTOP, then SIGCONT: silent, its connections open, as a host cut off is)
BROKER_FAULTS = ("leader", "controller", "silent leader")


class _Up:
    """`streamppo -v up` in a session of its own, its output in a file read as it grows (each line's arrival timed)."""

    def __init__(self, folder: Path, overrides: list[str], replicas: list[str], bootstrap: str | None = None):
        self.output = folder / "up.log"
        args = [sys.executable, "-m", "services.cli", "-v", "up", "--config", str(REPO / "examples/vowels/config.yaml")]
        args += ["--replicas", *replicas] if replicas else []
        args += ["--bootstrap", bootstrap] if bootstrap else []
        args += [a for o in overrides for a in ("--set", o)]
        with open(self.output, "w") as out:
            self.process = subprocess.Popen(
                args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.reader, self.partial, self.lines = open(self.output, errors="replace"), "", []  # (time.monotonic(), line)

    def tail(self) -> None:
        """The lines written since the last call, timed now (only what is new is read: the loop calls it often)."""
        text = self.partial + self.reader.read()
        *complete, self.partial = text.split("\n")
        now = time.monotonic()
        self.lines += [(now, line) for line in complete]

    def first(self, pattern: str, after: float) -> float | None:
        return next((at for at, line in self.lines if at >= after and re.search(pattern, line)), None)

    def stop(self) -> None:
        self.reader.close()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


def _overrides(folder: Path, run_id: str, steps: int, setting: str) -> list[str]:
    return [
        f"run.steps={steps}",
        f"run.dir={folder}/run",
        f"run.run_id={run_id}",
        "generation.backend=transformers",
        *SESSION,
        *SETTINGS[setting],
    ]


def _pids(role: str, run_id: str) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-f", f"replica-id {role}-0 .*run.run_id={run_id}"], capture_output=True, text=True
    )
    return [int(pid) for pid in found.stdout.split()]


def trial(setting: str, role: str, replicas: int, fault: str, steps: int = 24, fault_after: int = 8) -> dict:
    run_id = f"rec{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        metrics = folder / "run" / "metrics.jsonl"
        overrides = _overrides(folder, run_id, steps, setting)
        up = _Up(folder, overrides, [f"{role}={replicas}"] if replicas > 1 else [])
        seen, fault_at, resumed, deadline = [], None, False, time.monotonic() + 900
        try:
            while up.process.poll() is None and time.monotonic() < deadline:
                up.tail()
                lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
                seen += [time.monotonic()] * (lines - len(seen))
                if fault_at is None and lines >= fault_after:
                    pids = _pids(role, run_id)
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                    fault_at = time.monotonic()
                if fault == "stop" and fault_at is not None and not resumed and time.monotonic() > fault_at + STOPPED_S:
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
                    resumed = True
                time.sleep(0.02)
            up.tail()
        finally:
            up.stop()
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        code = up.process.returncode
    name = f"{role}-0"
    restarted = up.first(rf"{name} exited with code", fault_at) if fault_at is not None else None
    serving = up.first(rf"{name} \|.*{name}: serving", restarted) if restarted is not None else None
    return {
        "setting": setting,
        "role": role,
        "replicas": replicas,
        "fault": "kill -9" if fault == "kill" else f"SIGSTOP {STOPPED_S:.0f} s",
        "exit_code": code,
        **_outcome(seen, fault_at, fault_after, records, steps),
        "start_s": serving - restarted if serving is not None else None,
    }


def _outcome(seen: list[float], fault_at: float | None, fault_after: int, records: list[dict], steps: int) -> dict:
    """What a fault cost, from the times the updates came (``seen``) and the learner's metrics lines."""
    before = [b - a for a, b in zip(seen[: fault_after - 1], seen[1:fault_after])]
    after = [b - a for a, b in zip(seen[fault_after - 1 :], seen[fault_after:])]
    groups = [key for record in records for key in record.get("groups", [])]
    return {
        "updates": len(records),
        "median_gap_s": statistics.median(before) if before else None,
        "to_next_update_s": next((at - fault_at for at in seen if fault_at is not None and at > fault_at), None),
        "pause_s": max(after) - statistics.median(before) if after and before else None,
        "dropped_stale": records[-1].get("dropped_stale", 0) if records else None,
        "every_version_once": [r["step"] for r in records] == list(range(1, steps + 1)),
        "every_group_once": len(groups) == len(set(groups)),
    }


def broker_trial(setting: str, fault: str, steps: int = 24, fault_after: int = 8) -> dict:
    """One of :data:`BROKER_FAULTS` on a cluster of three brokers of their own, the run under ``up --bootstrap``."""
    from services.transport.brokers.apache_kafka import KafkaCluster

    run_id = f"brk{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        metrics = folder / "run" / "metrics.jsonl"
        cluster = KafkaCluster(folder / "cluster", 3, settings=BROKER_BEFORE if setting == "before" else None).start()
        overrides = _overrides(folder, run_id, steps, setting)
        up = _Up(folder, overrides, [], bootstrap=cluster.bootstrap)
        seen, fault_at, victim, back, deadline = [], None, None, False, time.monotonic() + 900
        try:
            while up.process.poll() is None and time.monotonic() < deadline:
                lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
                seen += [time.monotonic()] * (lines - len(seen))
                if fault_at is None and lines >= fault_after:
                    victim = cluster.node(
                        cluster.controller() if fault == "controller" else min(cluster.leaders(f"{run_id}.experience"))
                    )
                    if fault == "silent leader":
                        os.killpg(victim.process.pid, signal.SIGSTOP)
                    else:
                        victim.kill()
                    fault_at = time.monotonic()
                if fault_at is not None and not back and time.monotonic() > fault_at + STOPPED_S:
                    if fault == "silent leader":
                        os.killpg(victim.process.pid, signal.SIGCONT)
                    else:
                        victim.start()
                    back = True
                time.sleep(0.02)
        finally:
            up.stop()
            if victim is not None and victim.running:
                os.killpg(victim.process.pid, signal.SIGCONT)
            cluster.stop()
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {
        "setting": setting,
        "fault": fault,
        "exit_code": up.process.returncode,
        **_outcome(seen, fault_at, fault_after, records, steps),
    }


def bench_recovery() -> dict:
    rows = []
    for role, replicas, fault in FAULTS:
        for setting in SETTINGS:  # side by side: each fault under both settings, one after the other
            print(f"[recovery] {setting}: {fault} {role}-0 of {replicas}", file=sys.stderr, flush=True)
            rows.append(trial(setting, role, replicas, fault))
    brokers = []
    for fault in BROKER_FAULTS:
        for setting in SETTINGS:
            print(f"[recovery] {setting}: three brokers, {fault}", file=sys.stderr, flush=True)
            brokers.append(broker_trial(setting, fault))
    print("[recovery] broker loss (local broker), then up --resume on a new one", file=sys.stderr, flush=True)
    return {
        "brokers": brokers,
        "broker_loss": resume_after_broker_loss(),
        "setup": "streamppo up on Apache Kafka (one broker, started by up), tiny model, transformers generator, 6 s "
        "consumer sessions, checkpoint_every 1; the fault to replica 0 of the role after 8 of 24 updates; `up` "
        "restarts a killed replica at once; under each setting, one trial per fault",
        "settings": {name: list(values) for name, values in SETTINGS.items()},
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
            "kafka.static_members=false",
        ]

        def up(*extra):
            args = [sys.executable, "-m", "services.cli", "up", "--config", str(REPO / "examples/vowels/config.yaml")]
            args += ["--bootstrap", f"127.0.0.1:{port}", *extra, *(a for o in overrides for a in ("--set", o))]
            return subprocess.Popen(
                args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )

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


if __name__ == "__main__":
    only = sys.argv[1:]  # e.g. "scorer:2:kill" or "leader" to run one fault under both settings
    for role, replicas, fault in [f for f in FAULTS if not only or ":".join(map(str, f)) in only]:
        for setting in SETTINGS:
            print(json.dumps(trial(setting, role, replicas, fault)), flush=True)
    for fault in [f for f in BROKER_FAULTS if not only or f in only]:
        for setting in SETTINGS:
            print(json.dumps(broker_trial(setting, fault)), flush=True)
