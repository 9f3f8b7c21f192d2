"""What only a real Apache Kafka can show: a broker killed and started again on its log, a cluster of three that
loses brokers, the compacted weights topic compacted, records at the size limit, a group rebalanced as scorers come and
go. Each test starts brokers of its own (services/transport/brokers/apache_kafka.py) from Maven Central's jars."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import EXAMPLE, REPO
from helpers import run_settings, started_replica
from processes import STREAMING, Run, command, unique

from common.schema import encode
from services.runtime.run_bus import kafka_bus
from services.transport import TopicSpec
from services.transport.brokers.apache_kafka import KafkaBroker, KafkaCluster

pytestmark = pytest.mark.slow  # brokers and services as processes


def test_the_weights_topic_is_compacted_and_a_late_replica_reads_only_the_newest(tmp_path, make_config):
    """After many updates on small segments, Kafka's cleaner leaves each model's newest announcements: a replica that
    starts late reads a handful of records, not every version's, and loads the newest weights."""
    from helpers import announce_v1

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
    """kafka-python 3.0.12 against Apache Kafka 4.4, which dropped old protocol versions (KIP-896; an open report has
    ListOffsets v0 refused by 4.0, dpkp/kafka-python#2679): admin (create, describe configs, delete topics), the
    idempotent producer, a group's commit and committed offsets, ListOffsets (earliest, latest, by time)."""
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

    bootstrap = next(o for o in kafka_broker if o.startswith("kafka.bootstrap=")).split("=", 1)[1].split(",")
    topic = f"api-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="api-check")
    try:
        admin.create_topics([NewTopic(topic, 2, 1, topic_configs={"cleanup.policy": "compact"})])
        described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)], config_filter="all")
        entries = {name: config["value"] for name, config in described["topic"][topic].items()}
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
    from helpers import streamppo
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType

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
            assert {len(p["replica_nodes"]) for t in described for p in t["partitions"]} == {3}
            configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, names[0])], config_filter="all")
            entries = {name: config["value"] for name, config in configs["topic"][names[0]].items()}
            assert entries["min.insync.replicas"] == "2"
        finally:
            admin.close()
        one = topics(f"run.run_id={run_id}-1", "kafka.replication_factor=1")
        assert one.returncode == 0, one.stderr
        assert "WARNING: 22 topic(s) keep one copy on a cluster of 3 brokers" in one.stdout, one.stdout


def test_one_of_two_scorers_killed_under_up_is_removed_and_the_other_holds_its_partitions_at_once(
    tmp_path, model_cache
):
    """kill -9 of one scorer of two under `up`, with 20 s consumer sessions: up sees it exit and removes it from its
    group (it is a static member, named by its replica id), and the other scorer holds every partition of the
    group well within half the session, which alone would have freed them otherwise; the killed one, started
    again, joins as itself, and every version and group is trained once."""
    from kafka import KafkaAdminClient

    session_s = 20
    with KafkaBroker(tmp_path / "kafka") as broker:
        run = Run(
            tmp_path, model_cache, broker.bootstrap, 10, "--replicas", "scorer=2",
            settings=[*STREAMING, f"kafka.session_timeout_ms={session_s * 1000}", "kafka.heartbeat_interval_ms=250"],
        )  # fmt: skip
        admin = KafkaAdminClient(bootstrap_servers=[broker.bootstrap], client_id="test-groups")
        try:

            def held() -> dict[str, set[int]]:
                """The partitions each member of the run's scorer group holds, by its group.instance.id."""
                prefix = f"{run.run_id}.scorer."
                groups = [g["group_id"] for g in admin.list_groups() if g["group_id"].startswith(prefix)]
                members: dict[str, set[int]] = {}
                for group in admin.describe_groups(groups).values() if groups else ():
                    for member in group["members"]:
                        assigned = (member.get("member_assignment") or {}).get("assigned_partitions") or ()
                        members.setdefault(member["group_instance_id"], set()).update(
                            p for topic in assigned for p in topic["partitions"]
                        )
                return members

            run.wait_updates(2)
            deadline = time.monotonic() + 60
            while not all((before := held()).get(f"scorer-{i}") for i in (0, 1)):
                assert time.monotonic() < deadline, f"both scorers never held partitions: {before}"
                time.sleep(0.1)
            every = before["scorer-0"] | before["scorer-1"]
            subprocess.run(["pkill", "-9", "-f", f"replica-id scorer-0 .*run.run_id={run.run_id}"], check=True)
            killed = time.monotonic()
            while held().get("scorer-1") != every:
                assert time.monotonic() - killed < session_s, f"scorer-1 holds {held()} {session_s} s after the kill"
                time.sleep(0.05)
            took = time.monotonic() - killed
            print(f"scorer-1 held every partition {took:.2f} s after scorer-0's kill -9 ({session_s} s sessions)")
            records = run.finish()
        finally:
            admin.close()
            run.stop()
    assert took < session_s / 2, f"scorer-1 held scorer-0's partitions {took:.1f} s after the kill"
    assert "scorer-0 removed from its consumer group" in run.log(), run.log()[-3000:]
    run.assert_every_version_and_group_once(records)
