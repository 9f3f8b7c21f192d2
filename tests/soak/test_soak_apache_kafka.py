"""Long runs on Apache Kafka: the broker killed mid-run, a three-broker cluster losing brokers, scorers scaled on
Kafka, `up` and its broker killed."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO
from helpers import assert_each_group_once, run_settings
from processes import STREAMING, Run, command, unique

from services.transport.brokers.apache_kafka import KafkaBroker, KafkaCluster

pytestmark = pytest.mark.slow  # brokers and services as processes


@pytest.mark.soak
def test_kill_9_of_the_broker_mid_run_loses_nothing_and_the_log_is_the_same(tmp_path, model_cache):
    """Apache Kafka killed (-9) mid-run and started again on its log folder: the services wait for it, then go on on
    the same log (no new-log recovery), every version and group exactly once. Prints the time from the broker's
    return to the next update. (make test: Kafka's container killed mid-run in the compose test, the same checks.)"""
    broker = KafkaBroker(tmp_path / "kafka").start()
    run = Run(tmp_path, model_cache, broker.bootstrap, 10, settings=STREAMING)
    try:
        run.wait_updates(4)
        broker.kill()
        time.sleep(3)  # away: sends and fetches fail meanwhile
        at = run.updates()
        broker.start()
        back = time.monotonic()
        resumed = run.wait_updates(at + 1)
        print(f"\nbroker killed at update {at}; next update {resumed - back:.1f} s after it served again")
        records = run.finish()
    finally:
        run.stop()
        broker.stop()
    run.assert_every_version_and_group_once(records)


def wait_in_sync(bootstrap: str, timeout_s: float = 180.0) -> None:
    """Until every partition of every topic has all its replicas in sync again: a broker started again catches up
    before it counts, and a broker killed before that would take the only copy of some partitions with it (Kafka
    then waits for it, rightly, rather than lose what it acknowledged)."""
    from kafka import KafkaAdminClient

    deadline = time.monotonic() + timeout_s
    while True:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), client_id="test-isr")
        try:
            lagging = [
                (topic["name"], p["partition_index"])
                for topic in admin.describe_topics()
                for p in topic["partitions"]
                if sorted(p["isr_nodes"]) != sorted(p["replica_nodes"])
            ]
        finally:
            admin.close()
        if not lagging:
            return
        assert time.monotonic() < deadline, f"replicas not in sync after {timeout_s:.0f} s: {lagging[:5]}"
        time.sleep(1)


@pytest.mark.soak
def test_a_three_broker_cluster_loses_a_broker_then_its_controller_then_two_and_nothing_else(tmp_path, model_cache):
    """Replication 3, min.insync.replicas 2, acks=all. The leader of the experience partitions is killed mid-run,
    then the active controller, each started again: every version once, the pause per kill measured. Then two brokers
    at once: writes stop (no quorum, too few in sync) and the services say what they wait for; one comes back and
    the run finishes, nothing lost."""
    cluster = KafkaCluster(tmp_path / "cluster", 3).start()
    run = Run(tmp_path, model_cache, cluster.bootstrap, 24, settings=STREAMING)  # replication 3: the cluster's
    pauses = []
    try:
        run.wait_updates(3)
        topic = f"{run.run_id}.experience"
        for what in ("leader of the experience partitions", "active controller"):
            victim = min(cluster.leaders(topic)) if what.startswith("leader") else cluster.controller()
            at = run.updates()
            killed = time.monotonic()
            cluster.node(victim).kill()
            pauses.append((what, victim, run.wait_updates(at + 1) - killed))
            cluster.node(victim).start()
            wait_in_sync(cluster.bootstrap)
        at = run.updates()
        controller = cluster.controller()
        away = [next(node for node in cluster.nodes if node.node_id != controller), cluster.node(controller)]
        before = len(run.log())
        for node in away:
            node.kill()
        time.sleep(20)
        stalled = run.updates()
        assert stalled <= at + 1, "with two of three brokers away nothing more is written"
        # What the services said meanwhile (their own lines: kafka-python's, under -v, are many more).
        said = "\n".join(line for line in run.log()[before:].splitlines() if "services." in line)
        away[0].start()
        run.wait_updates(stalled + 1)
        away[1].start()
        records = run.finish()
    finally:
        run.stop()
        cluster.stop()
    for what, victim, pause in pauses:
        print(f"\nkilled node {victim}, the {what}: next update {pause:.1f} s later")
    assert re.search(r"not reachable|unavailable|NotEnoughReplicas|waiting|retry", said, re.I), said[-3000:]
    run.assert_every_version_and_group_once(records)


@pytest.mark.soak
def test_scorers_three_then_one_then_three_rebalance_on_kafka_and_every_record_goes_once(tmp_path, model_cache):
    """Scorer replicas come and go during a run (3 → 1 → 3): the group rebalances on Kafka each time, every record is
    scored once (each group trained once, every version once), and the memory broker's wedge workaround never
    fires. (make test: the rebalances themselves on Kafka in test_kafka.py, a leader that left mid-rebalance and a
    wedged group left for a new one; two scorers under `up`; three in compose, through a kill.)"""
    broker = KafkaBroker(tmp_path / "kafka").start()
    run = Run(tmp_path, model_cache, broker.bootstrap, 24, settings=STREAMING)
    extra: dict[str, subprocess.Popen] = {}

    def scorer(name: str) -> subprocess.Popen:
        with open(tmp_path / f"{name}.log", "w") as log:
            return subprocess.Popen(
                # As up's own replicas are given it: the run's key (a scorer without it is refused downstream).
                command("scorer", "--replica-id", name, "--bootstrap", broker.bootstrap,
                        settings=[*run.settings, "pipeline.run_key=true"]),
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    try:
        extra = {name: scorer(name) for name in ("scorer-x", "scorer-y")}  # with up's scorer-0: three
        run.wait_updates(4)
        for name in list(extra):  # down to one
            extra.pop(name).send_signal(signal.SIGTERM)
        at = run.updates()
        run.wait_updates(at + 4)
        extra = {name: scorer(name) for name in ("scorer-z", "scorer-w")}  # three again
        records = run.finish()
    finally:
        run.stop()
        for process in extra.values():
            process.kill()
        broker.stop()
    run.assert_every_version_and_group_once(records)
    for log in tmp_path.glob("scorer-*.log"):
        assert "has given no partition" not in log.read_text(), log.name


@pytest.mark.soak
def test_up_runs_on_apache_kafka_and_its_log_outlives_a_killed_up_and_broker(tmp_path, model_cache):
    """`streamppo up` names the broker it started in its first line: Apache Kafka, the run's log in the run
    directory. `up` killed (-9) mid-run takes its services and its broker down (as a machine's restart would);
    `up --resume` starts Kafka again on that log, and the run finishes with every version and group once."""
    steps, run_id = 12, unique("up")
    settings = [*run_settings(tmp_path, model_cache, steps, run_id), "generation.backend=transformers", *STREAMING]
    metrics = tmp_path / "run" / "metrics.jsonl"

    def up(*args: str, log_name: str) -> subprocess.Popen:
        with open(tmp_path / log_name, "w") as log:
            return subprocess.Popen(command("up", *args, settings=settings), cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    first = up(log_name="up-1.log")
    try:
        deadline = time.monotonic() + 300
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 4:
            assert time.monotonic() < deadline and first.poll() is None, (tmp_path / "up-1.log").read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGKILL)  # up and its services; its broker follows (parent-death signal)
        first.wait(timeout=30)
        broker_dir = tmp_path / "run" / "kafka"
        deadline = time.monotonic() + 60
        while any(str(broker_dir) in _text(p) for p in Path("/proc").glob("[0-9]*/cmdline")):
            assert time.monotonic() < deadline, "the broker outlived the up that started it"
            time.sleep(0.5)
        second = up("--resume", log_name="up-2.log")
        assert second.wait(timeout=600) == 0, (tmp_path / "up-2.log").read_text()[-3000:]
    finally:
        for process in (first, locals().get("second")):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    for name, kept in (("up-1.log", "(new)"), ("up-2.log", "(taken up again)")):
        said = [line for line in (tmp_path / name).read_text().splitlines() if not re.match(r"\d{4}-\d\d-\d\d ", line)]
        head = said[0]  # up's own first line (log records of the preflight, a model built once, aside)
        assert head.startswith("Apache Kafka 4.4.0 serving on") and kept in head, head
    records = [json.loads(line) for line in metrics.open()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "every version applied exactly once"
    assert_each_group_once(records, run_id, steps * 8 // 16)
    assert "going on on the new log" not in (tmp_path / "up-2.log").read_text(), "the same log, taken up again"


def _text(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except OSError:  # a process that ended meanwhile
        return ""
