"""What only a real Apache Kafka can show: a broker killed and started again on its log, a cluster of three that
loses brokers, the compacted weights topic compacted, records at the size limit, a group rebalanced as scorers come and
go. Each test starts brokers of its own (services/transport/brokers/apache_kafka.py) from Maven Central's jars."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import EXAMPLE, REPO
from helpers import assert_each_group_once, run_settings, started_replica

from common.schema import encode
from services.runtime.run_bus import kafka_bus
from services.transport import TopicSpec
from services.transport.brokers.apache_kafka import KafkaBroker, KafkaCluster

pytestmark = pytest.mark.slow  # brokers and services as processes

# Short sessions, as `up` gives the broker it starts: a killed replica's partitions move on in seconds.
KAFKA_SETTINGS = ("kafka.session_timeout_ms=1000", "kafka.heartbeat_interval_ms=250", "kafka.connect_timeout_s=180")
STREAMING = ("generation.streaming=true", "generation.groups_per_record=4", "learner.groups_per_update=8")


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def command(*args: str, settings=()) -> list[str]:
    line = [sys.executable, "-m", "services.cli", "-v", *args, "--config", str(EXAMPLE / "config.yaml")]
    return line + [a for s in settings for a in ("--set", s)]


class Run:
    """`streamppo -v up` in the background on a broker the test owns, its output in a file, its metrics read."""

    def __init__(self, tmp_path: Path, model_cache, bootstrap: str, steps: int, *up_args, settings=()):
        self.tmp_path, self.steps, self.bootstrap = tmp_path, steps, bootstrap
        self.run_id = unique("kafka")
        self.settings = [
            *run_settings(tmp_path, model_cache, steps, self.run_id),
            "generation.backend=transformers",
            *KAFKA_SETTINGS,
            *settings,
        ]
        self.output = tmp_path / "up.log"
        self.metrics = tmp_path / "run" / "metrics.jsonl"
        with open(self.output, "w") as log:
            self.process = subprocess.Popen(
                command("up", "--bootstrap", bootstrap, *up_args, settings=self.settings),
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def updates(self) -> int:
        return len(self.metrics.read_text().splitlines()) if self.metrics.exists() else 0

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    def wait_updates(self, count: int, timeout_s: float = 300.0) -> float:
        """Wait until ``count`` updates are done; returns when (time.monotonic())."""
        deadline = time.monotonic() + timeout_s
        while self.updates() < count:
            assert time.monotonic() < deadline and self.process.poll() is None, self.log()[-4000:]
            time.sleep(0.1)
        return time.monotonic()

    def finish(self, timeout_s: float = 600.0) -> list[dict]:
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            status = subprocess.run(
                [sys.executable, "-m", "services.cli", "status", "--run-dir", str(self.tmp_path / "run")],
                cwd=REPO, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            pytest.fail(f"the run stalled; streamppo status:\n{status.stdout}{status.stderr}\n{self.log()[-3000:]}")
        assert code == 0, self.log()[-4000:]
        return [json.loads(line) for line in self.metrics.open()]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)

    def assert_every_version_and_group_once(self, records: list[dict]) -> None:
        assert [r["step"] for r in records] == list(range(1, self.steps + 1)), "every version applied exactly once"
        assert_each_group_once(records, self.run_id, self.steps * 8 // 16)
        text = self.log()
        assert "going on on the new log" not in text and "again in resume mode" not in text, "the log is the same one"
        assert "has given no partition" not in text, "the wedge workaround (the memory broker's group bug) never fired"


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


def quorum_leader(cluster: KafkaCluster) -> int:
    """The node id of the active controller: the leader of the newest epoch the live nodes' quorum-state files name
    (one node's file may be a term behind)."""
    known = []
    for node in cluster.nodes:
        state = node.directory / "data" / "__cluster_metadata-0" / "quorum-state"
        if node.running and state.exists():
            data = json.loads(state.read_text())
            if data.get("leaderId", -1) > 0:
                known.append((data.get("leaderEpoch", 0), data["leaderId"]))
    assert known, "no node knows the quorum's leader"
    return max(known)[1]


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
                (topic["topic"], p["partition"])
                for topic in admin.describe_topics()
                for p in topic["partitions"]
                if sorted(p["isr"]) != sorted(p["replicas"])
            ]
        finally:
            admin.close()
        if not lagging:
            return
        assert time.monotonic() < deadline, f"replicas not in sync after {timeout_s:.0f} s: {lagging[:5]}"
        time.sleep(1)


def partition_leaders(bootstrap: str, topic: str) -> set[int]:
    from kafka import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), client_id="test-leaders")
    try:
        (described,) = admin.describe_topics([topic])
        return {partition["leader"] for partition in described["partitions"]}
    finally:
        admin.close()


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
            victim = (
                min(partition_leaders(cluster.bootstrap, topic))
                if what.startswith("leader")
                else quorum_leader(cluster)
            )
            at = run.updates()
            killed = time.monotonic()
            cluster.node(victim).kill()
            pauses.append((what, victim, run.wait_updates(at + 1) - killed))
            cluster.node(victim).start()
            wait_in_sync(cluster.bootstrap)
        at = run.updates()
        controller = quorum_leader(cluster)
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


def test_the_weights_topic_is_compacted_and_a_late_replica_reads_only_the_newest(tmp_path, make_config):
    """After many updates on small segments, Kafka's cleaner leaves each model's newest announcements: a replica that
    starts late reads a handful of records, not every version's, and loads the newest weights."""
    from test_runtime import announce_v1

    from services.generator import GeneratorService
    from services.roles import WEIGHTS_TOPIC, pipeline_topics

    with KafkaBroker(tmp_path / "kafka") as broker:
        config = make_config(
            f"kafka.bootstrap={broker.bootstrap}", "data.batch_size=2", "generation.n=2", "learner.mini_batch_size=4"
        )
        bus = kafka_bus(config, make=False)
        # The run's weights topic made first, on segments that roll every 100 ms and a cleaner that takes any dirt.
        small = {"segment.ms": "100", "min.cleanable.dirty.ratio": "0.01", "delete.retention.ms": "0"}
        weights = next(spec for spec in pipeline_topics(1) if spec.name == WEIGHTS_TOPIC)
        bus.create_topics([dataclasses.replace(weights, settings=tuple(small.items()))])
        bus.create_topics(pipeline_topics(1))
        producer, versions = bus.producer("learner"), 30
        for version in range(1, versions + 1):
            newest = announce_v1(config, version)
            for announcement in newest:
                producer.send(WEIGHTS_TOPIC, encode(announcement), key=announcement.model.encode())
            producer.flush()
            time.sleep(0.15)  # a segment per version

        def read_back() -> int:
            reader, records = bus.consumer(WEIGHTS_TOPIC, None, f"count-{uuid.uuid4().hex[:6]}"), []
            while batch := reader.poll(2.0, max_records=1000):
                records += batch
            reader.close()
            return len(records)

        deadline = time.monotonic() + 120
        while (left := read_back()) > 8:  # 2 models × 30 versions written
            assert time.monotonic() < deadline, f"the cleaner left {left} of {2 * versions} announcements"
            for announcement in newest:  # a write rolls the active segment, which the cleaner does not touch
                producer.send(WEIGHTS_TOPIC, encode(announcement), key=announcement.model.encode())
            producer.flush()
            time.sleep(2)
        late_replica = started_replica(GeneratorService(config, "generator-late"), bus)
        late = late_replica.runner
        deadline = time.monotonic() + 60
        while late.weights.loaded.get("actor") != versions:
            assert time.monotonic() < deadline, late.weights.loaded
            late.poll_once(0.2)
        late_replica.stop(finished=False)
    print(f"\n{left} announcements left of {2 * versions} written; the late replica loaded v{versions}")


def test_a_cluster_id_that_would_start_with_a_dash_formats_and_serves(tmp_path):
    """The id of seed-48 hashed to one starting with "-", which kafka-storage's command line took for an option: one
    start in 64 failed to format its log. The id is drawn again, and the broker formats and answers."""
    from services.transport.brokers.apache_kafka import KafkaBroker, _kafka_uuid

    assert all(not _kafka_uuid(f"seed-{i}").startswith("-") and len(_kafka_uuid(f"seed-{i}")) == 22 for i in range(500))
    broker = KafkaBroker(tmp_path / "kafka", cluster_id="seed-48").start()
    try:
        assert _kafka_uuid("seed-48") in (tmp_path / "kafka" / "data" / "meta.properties").read_text()
    finally:
        broker.stop()


def test_a_broker_whose_controller_port_is_held_says_so_and_exits(tmp_path):
    """Another process holds the controller's port (what failed a compose run once: the image took KAFKA_PORT + 1):
    start() fails at once with Kafka's own cause, not a stack trace's last lines."""
    import socket

    from services.transport.brokers.apache_kafka import KafkaUnavailable

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(KafkaUnavailable, match=rf"failed to bind to 127.0.0.1:{port}: Address already in use"):
            KafkaBroker(tmp_path / "kafka", controller_port=port).start()


def test_a_record_at_the_size_limit_goes_through_kafka(make_config, kafka_broker):
    """A 60 MiB record (kafka.max_message_bytes is 64 MiB): the topic, the broker (message.max.bytes) and the
    clients' fetch limits all take it."""
    bus = kafka_bus(make_config(*kafka_broker), make=False)
    topic = f"big-{uuid.uuid4().hex[:8]}"
    bus.create_topics([TopicSpec(topic, 1)])
    payload = os.urandom(60 * 1024 * 1024)
    producer = bus.producer("big")
    producer.send(topic, payload)
    producer.flush()
    reader, got, deadline = bus.consumer(topic, None, "big-reader"), [], time.monotonic() + 120
    while not got and time.monotonic() < deadline:
        got = reader.poll(1.0)
    assert len(got) == 1 and got[0].value == payload


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


def test_a_stopped_up_says_how_to_resume_and_resumes_from_its_run_directory_alone(tmp_path, model_cache):
    """Ctrl-C of `up`: it says after which update it stopped and the command that resumes it; `up --resume --run-dir
    DIR`, with no config, no --set and no --replicas, takes the run up as it ran (two scorers, its settings) and ends
    it, its time counted across both."""
    steps, run_id = 6, unique("stop")
    settings = [*run_settings(tmp_path, model_cache, steps, run_id), "generation.backend=transformers"]
    run_dir, metrics = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
    with open(tmp_path / "up-1.log", "w") as log:
        first = subprocess.Popen(command("up", "--replicas", "scorer=2", settings=settings), cwd=REPO, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
            assert time.monotonic() < deadline and first.poll() is None, (tmp_path / "up-1.log").read_text()[-3000:]
            time.sleep(0.2)
        first.send_signal(signal.SIGINT)
        first.wait(timeout=180)
        stopped_at = len(metrics.read_text().splitlines())
        first_seconds = json.loads((run_dir / "up.json").read_text())["seconds"]
        resumed = subprocess.run(
            [sys.executable, "-m", "services.cli", "-v", "up", "--resume", "--run-dir", str(run_dir)],
            cwd=REPO, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    said = (tmp_path / "up-1.log").read_text()
    assert f"stopped after update {stopped_at} of {steps}; resume with `streamppo up --resume --run-dir {run_dir}`" in (
        said
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "scorer-1 |" in resumed.stdout, "the replicas it ran with, two scorers"
    records = [json.loads(line) for line in metrics.open()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "every version applied exactly once"
    assert json.loads((run_dir / "summary.json").read_text())["wall_seconds"] > first_seconds, "both ups counted"


def test_a_second_up_on_a_finished_run_directory_trains_from_scratch_and_says_so(tmp_path, model_cache):
    """`up` on the run directory of a run that finished (`make run`'s, then `up`, both runs/vowels) clears it and
    trains the run again, saying so; before, its learner took up the finished checkpoint, trained nothing, and
    printed the earlier run's `done:` line as its own."""
    steps = 2
    settings = [*run_settings(tmp_path, model_cache, steps, unique("twice")), "generation.backend=transformers"]
    metrics = tmp_path / "run" / "metrics.jsonl"
    said = []
    for _ in range(2):
        done = subprocess.run(command("up", settings=settings), cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        records = [json.loads(line) for line in metrics.open()]
        assert [r["step"] for r in records] == list(range(1, steps + 1)), "this up's own updates, each once"
        said.append((done.stdout, metrics.stat().st_mtime))
    (first, first_written), (second, second_written) = said
    assert "cleared the earlier run" not in first
    assert f"cleared the earlier run in {tmp_path / 'run'} ({steps} updates, its checkpoints and summary)" in second
    assert second_written > first_written and f"done: {steps} steps" in second, "trained again, not reported again"
    assert "the run's log (new)" in second, "on a log of its own, not the earlier run's"


def test_kafka_python_speaks_every_api_the_project_uses_to_kafka_4(kafka_broker):
    """kafka-python 2.3.3 against Apache Kafka 4.4, which dropped old protocol versions (KIP-896; an open report has
    ListOffsets v0 refused by 4.0, dpkp/kafka-python#2679): admin (create, describe configs, delete topics), the
    idempotent producer, a group's commit and committed offsets, ListOffsets (earliest, latest, by time)."""
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

    bootstrap = next(o for o in kafka_broker if o.startswith("kafka.bootstrap=")).split("=", 1)[1].split(",")
    topic = f"api-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="api-check")
    try:
        admin.create_topics([NewTopic(topic, 2, 1, topic_configs={"cleanup.policy": "compact"})])
        (described,) = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        entries = {e[0]: e[1] for r in described.resources for e in r[4]}
        assert entries["cleanup.policy"] == "compact"
        producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
        sent_at = int(time.time() * 1000)
        for i in range(6):
            producer.send(topic, f"v{i}".encode(), key=f"k{i}".encode(), partition=i % 2)
        producer.flush()
        producer.close()
        partitions = [TopicPartition(topic, p) for p in (0, 1)]
        consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=f"g-{topic}", enable_auto_commit=False,
                                 auto_offset_reset="earliest")  # fmt: skip
        assert consumer.beginning_offsets(partitions) == {tp: 0 for tp in partitions}
        assert consumer.end_offsets(partitions) == {tp: 3 for tp in partitions}
        by_time = consumer.offsets_for_times({tp: sent_at - 60_000 for tp in partitions})
        assert all(found.offset == 0 for found in by_time.values())
        consumer.subscribe([topic])
        got, deadline = [], time.monotonic() + 30
        while len(got) < 6 and time.monotonic() < deadline:
            for records in consumer.poll(500).values():
                got += records
        assert sorted(r.value for r in got) == [f"v{i}".encode() for i in range(6)]
        consumer.commit()
        assert {tp: consumer.committed(tp) for tp in partitions} == {tp: 3 for tp in partitions}
        consumer.close()
        admin.delete_topics([topic])
    finally:
        admin.close()


def test_a_replicated_cluster_gets_replicated_topics_and_one_copy_is_warned_of(tmp_path, make_config):
    """Three brokers whose default.replication.factor is Kafka's own (1), no kafka.replication_factor: the run's
    topics get 3 copies and min.insync.replicas 2; `topics` says so, and warns of a run whose setting asks for one."""
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType
    from test_config import streamppo

    from services.roles import pipeline_topics

    with KafkaCluster(tmp_path / "cluster", 3, settings={"default.replication.factor": "1"}) as cluster:
        run_id = f"rf{uuid.uuid4().hex[:6]}"

        def topics(*settings):
            settings = [arg for setting in settings for arg in ("--set", setting)]
            return streamppo("topics", "--config", EXAMPLE / "config.yaml", "--bootstrap", cluster.bootstrap, *settings)

        result = topics(f"run.run_id={run_id}")
        assert result.returncode == 0, result.stderr
        assert "topics: 3 copies each on 3 broker(s)" in result.stdout and "WARNING" not in result.stdout
        admin = KafkaAdminClient(bootstrap_servers=cluster.bootstrap.split(","))
        try:
            names = [f"{run_id}.{spec.name}" for spec in pipeline_topics()]
            described = admin.describe_topics(names)
            assert {len(p["replicas"]) for t in described for p in t["partitions"]} == {3}
            configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, names[0])])
            entries = {e[0]: e[1] for r in configs for res in r.resources for e in res[4]}
            assert entries["min.insync.replicas"] == "2"
        finally:
            admin.close()
        one = topics(f"run.run_id={run_id}-1", "kafka.replication_factor=1")
        assert one.returncode == 0, one.stderr
        assert "WARNING: 22 topic(s) keep one copy on a cluster of 3 brokers" in one.stdout, one.stdout
