"""The Kafka bus against a real broker started by the tests: the log's identity, an unreachable broker, groups that
wedge, broadcast readers."""

import time

import pytest
from helpers import (
    broker_address,
    is_local_broker,
)
from processes import drain, fill, unique

from services.runtime.run_bus import kafka_bus
from services.transport import TopicSpec
from services.transport.brokers.local_broker import free_port
from services.transport.kafka import BrokerUnavailable, KafkaBus, KafkaSettings

pytestmark = pytest.mark.slow  # services as processes and a broker per test where it needs one


def test_replicas_that_make_the_log_at_once_all_read_its_one_identity(kafka_config):
    """Services started together on an empty broker, with no `streamppo topics` first: each makes the run's topics
    (racing the others) and its identity if it reads none; the first record is the log's, and each reads that one
    back, never none (a feeder under compose once read none back, its probe's high watermark still that of the
    empty partition; learners and advantage services of a fleet once read none while the topic was not yet in the
    broker's metadata, and crashed)."""
    import concurrent.futures

    from services.roles import LOG_TOPIC

    for attempt in range(4):
        config = kafka_config.model_copy(update={"run": kafka_config.run.model_copy(update={"run_id": unique("id")})})

        def start_replica(_, config=config):
            bus = kafka_bus(config)  # what every process does first: the topics made, the log's identity written
            return bus, bus.log_identity(LOG_TOPIC, create=True)  # and what its runner reads

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            started = list(pool.map(start_replica, range(6)))
        read = [identity for _, identity in started]
        assert None not in read and len(set(read)) == 1, (attempt, read)
        assert started[0][0].log_identity(LOG_TOPIC) == read[0], "what a later check reads: the same log"
        for bus, _ in started:
            bus.close()


def test_making_the_log_identity_waits_for_a_topic_made_a_moment_ago(kafka_config):
    """The topic is made while log_identity(create=True) asks: it answers the identity, never None."""
    import threading

    from services.roles import LOG_TOPIC, pipeline_topics

    config = kafka_config.model_copy(update={"run": kafka_config.run.model_copy(update={"run_id": unique("late")})})
    bus, maker = kafka_bus(config, make=False), kafka_bus(config, make=False)
    threading.Timer(1.5, maker.create_topics, args=(pipeline_topics(1),)).start()
    identity = bus.log_identity(LOG_TOPIC, create=True)
    assert identity and identity == maker.log_identity(LOG_TOPIC)
    bus.close(), maker.close()


def test_an_unreachable_broker_is_a_clear_error():
    bus = KafkaBus(KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}", connect_timeout_s=2))
    with pytest.raises(BrokerUnavailable, match="no Kafka broker reachable"):
        bus.producer("p")


def leave_mid_rebalance(bootstrap: str, topic: str, group: str) -> None:
    """Two plain kafka-python members of ``group`` take ``topic``'s partitions and commit offset 1 on each; then the
    follower leaves, and the leader leaves while the group rebalances. On the local broker (tansu) that wedges the
    group: it keeps naming the departed leader, and no member gets a partition again."""
    from kafka import KafkaConsumer
    from kafka.structs import OffsetAndMetadata

    def member(name):
        consumer = KafkaConsumer(
            bootstrap_servers=bootstrap.split(","),
            group_id=group,
            client_id=name,
            enable_auto_commit=False,
            session_timeout_ms=6000,  # Apache Kafka's least (group.min.session.timeout.ms)
            heartbeat_interval_ms=1000,
        )
        consumer.subscribe([topic])
        return consumer

    leader = member("leader")
    deadline = time.monotonic() + 30
    while not leader.assignment() and time.monotonic() < deadline:
        leader.poll(timeout_ms=200)
    follower = member("follower")
    while not (leader.assignment() and follower.assignment()) and time.monotonic() < deadline:
        leader.poll(timeout_ms=100)
        follower.poll(timeout_ms=100)
    assert leader.assignment() and follower.assignment(), "two members share the partitions"
    for consumer in (leader, follower):
        consumer.commit({tp: OffsetAndMetadata(1, "", -1) for tp in consumer.assignment()})
    follower.close()
    leader.poll(timeout_ms=50)  # the leader begins the rebalance the follower's leaving started ...
    leader.close()  # ... and leaves in the middle of it


def test_a_group_whose_leader_left_mid_rebalance_deals_out_its_partitions_again(kafka_broker):
    """Plain clients leave the group mid-rebalance; a replica that joins it then holds every partition, on any broker.
    The local broker (tansu 0.6) wedges such a group for good (it names the departed leader in every join, and no
    member of that group gets a partition again); the replica notices (members, joins, no assignment for longer
    than a few sessions) and moves on to the group's next generation, within seconds."""
    bootstrap = broker_address(kafka_broker)
    local = is_local_broker(kafka_broker)
    sessions = {"session_timeout_ms": 1000, "heartbeat_interval_ms": 250} if local else {}  # as `up` sets there
    bus = KafkaBus(KafkaSettings(bootstrap, idempotent_producer=not local, **sessions))
    topic, group = unique("wedge"), unique("group")
    bus.create_topics([TopicSpec(topic, 4)])
    leave_mid_rebalance(bootstrap, topic, group)
    started = time.monotonic()
    newcomer = bus.consumer(topic, group, "newcomer")
    while not newcomer.consumer.assignment() and time.monotonic() - started < 60:
        newcomer.poll(0.2, max_records=10)
    assigned, took = newcomer.consumer.assignment(), time.monotonic() - started
    moved = newcomer.group
    newcomer.close()
    print(f"\nthe newcomer held every partition {took:.1f} s after it joined (group {moved})")
    assert len(assigned) == 4, "the only member of the group holds every partition"
    assert took < 30, f"the wedge was left in {took:.1f} s"
    assert moved == (f"{group}~1" if local else group), "a new generation of the group only where it was wedged"


def test_a_replica_leaves_a_wedged_group_for_a_new_one_with_its_committed_offsets(kafka_broker):
    bootstrap = broker_address(kafka_broker)
    local = is_local_broker(kafka_broker)
    sessions = {"session_timeout_ms": 1000, "heartbeat_interval_ms": 250} if local else {}  # as `up` sets there
    bus = KafkaBus(KafkaSettings(bootstrap, idempotent_producer=not local, **sessions))
    topic, group = unique("wedge"), unique("group")
    bus.create_topics([TopicSpec(topic, 4)])
    producer = bus.producer("test")
    for i in range(8):  # two records per partition
        producer.send(topic, f"v{i}".encode(), partition=i % 4)
    producer.flush()
    leave_mid_rebalance(bootstrap, topic, group)  # the first record of each partition is committed
    replica = bus.consumer(topic, group, "replica")
    records = []
    deadline = time.monotonic() + 90
    while len(records) < 4 and time.monotonic() < deadline:
        records += replica.poll(0.5, max_records=10)
    assert sorted(r.value for r in records) == [b"v4", b"v5", b"v6", b"v7"], "what was committed is not read again"
    if local:  # the broker wedged the group, and the replica moved on (Apache Kafka does not wedge it)
        assert replica.group == f"{group}~1"
        late = bus.consumer(topic, group, "late")  # a replica that starts later joins the group in use
        assert late.group == f"{group}~1"
        late.close()
    replica.close()


def test_broadcast_readers_see_every_partition_from_the_start_and_leave_no_group(bus, kafka_config):
    from kafka import KafkaAdminClient

    topic, client = unique("broadcast"), unique("weights-reader")
    bus.create_topics([TopicSpec(topic, 3)])
    fill(bus, topic, 12)
    admin = KafkaAdminClient(bootstrap_servers=kafka_config.kafka.bootstrap.split(","), client_id="test-admin")
    groups = set()
    for _ in range(2):  # a restarted replica reads everything again, from the beginning
        reader = bus.consumer(topic, None, client)
        assert reader.consumer.consumer.config["group_id"] is None, "assigned its partitions, joined no group"
        assert sorted(drain(reader, 12)) == sorted(f"v{i}".encode() for i in range(12))
        groups |= {group["group_id"] for group in admin.list_groups()}  # while it reads (Apache Kafka lists them)
        reader.close()
    groups |= {group["group_id"] for group in admin.list_groups()}
    admin.close()
    assert not any(client in group for group in groups), f"a group per start: {groups}"


def test_without_static_members_there_is_no_member_to_remove_and_no_broker_is_asked():
    """`up` on the local broker (no static membership, and group descriptions kafka-python cannot parse): removing a
    replica that died is a no-op, not an error that would stop `up`."""
    bus = KafkaBus(KafkaSettings("127.0.0.1:1", static_members=False, connect_timeout_s=0.5))
    assert bus.remove_member("scorer-0") == []
