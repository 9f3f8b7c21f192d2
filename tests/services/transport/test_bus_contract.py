"""The bus contract (services/transport/base.py), one suite run against both buses: the in-memory bus, which every
fast test of the pipeline trusts, and Kafka over a real broker started by the tests.

Kafka answers over the network and rebalances groups in seconds; every wait here is for a count of records with a
deadline, never a fixed sleep, except where a test asserts that nothing arrives (``settle``).
"""

import threading
import time
import uuid

import pytest

from services.transport import MemoryBus, TopicSpec


class Contract:
    """One bus under test, with topics of its own."""

    def __init__(self, bus, settle_s: float, names_members: bool = True):
        self.bus, self.settle_s, self.names_members = bus, settle_s, names_members

    def topic(self, partitions: int) -> str:
        name = f"t-{uuid.uuid4().hex[:8]}"
        self.bus.create_topics([TopicSpec(name, partitions)])
        return name

    def fill(self, topic: str, count: int, first: int = 0) -> None:
        producer = self.bus.producer("contract")
        for i in range(first, first + count):
            producer.send(topic, f"v{i}".encode(), key=f"k{i}".encode())
        producer.flush()

    def group(self) -> str:
        return f"g-{uuid.uuid4().hex[:8]}"


@pytest.fixture(
    params=["memory", pytest.param("kafka", marks=pytest.mark.slow), pytest.param("local", marks=pytest.mark.slow)]
)
def contract(request):
    """The in-memory bus; the suite's broker (Apache Kafka); the local memory broker, `up`'s fallback without Java."""
    if request.param == "memory":
        yield Contract(MemoryBus(), settle_s=0.0)
        return
    from services.runtime.run_bus import kafka_bus

    broker = request.getfixturevalue("kafka_broker" if request.param == "kafka" else "memory_broker")
    bus = kafka_bus(request.getfixturevalue("make_config")(*broker))
    yield Contract(bus, settle_s=2.0, names_members=request.param == "kafka")
    bus.close()


def joined(*consumers, timeout_s: float = 60.0):
    """``consumers`` of one group, once each holds partitions: a group deals its partitions out as members join, and
    on Apache Kafka (no initial rebalance delay) the first to join reads everything before the second is in."""
    deadline = time.monotonic() + timeout_s
    while not all(consumer.assigned() for consumer in consumers):
        assert time.monotonic() < deadline, "the group never dealt partitions to every member"
        for consumer in consumers:
            assert not consumer.poll(0.1, max_records=100), "joined() is for members of a group with nothing to read"
    return consumers


def drain(consumers, expected: int, timeout_s: float = 60.0, commit: bool = True) -> list[list[bytes]]:
    """What each of ``consumers`` polls until they have ``expected`` records together (or the deadline)."""
    seen = [[] for _ in consumers]
    deadline = time.monotonic() + timeout_s
    while sum(map(len, seen)) < expected and time.monotonic() < deadline:
        for got, consumer in zip(seen, consumers):
            for record in consumer.poll(0.2, max_records=100):
                got.append(record.value)
                if commit:
                    consumer.commit(record)
    return seen


def nothing_more(contract, consumer) -> list[bytes]:
    """What ``consumer`` polls within the bus's settle time: nothing, if the contract holds."""
    deadline, got = time.monotonic() + contract.settle_s, []
    while True:
        got += [r.value for r in consumer.poll(0.1, max_records=100)]
        if time.monotonic() >= deadline:
            return got


def values(count: int, first: int = 0) -> list[bytes]:
    return [f"v{i}".encode() for i in range(first, first + count)]


def test_every_group_sees_every_record_and_members_share_the_partitions(contract):
    topic = contract.topic(4)
    group = contract.group()
    first, second = joined(contract.bus.consumer(topic, group, "first"), contract.bus.consumer(topic, group, "second"))
    contract.fill(topic, 40)
    one, two = drain([first, second], 40)
    assert sorted(one + two) == sorted(values(40)) and one and two, "split between the members, each record once"
    (other,) = drain([contract.bus.consumer(topic, contract.group(), "other")], 40)
    assert sorted(other) == sorted(values(40)), "another group reads everything again"


def test_one_key_one_partition_in_order(contract):
    topic = contract.topic(3)
    producer = contract.bus.producer("p")
    for i in range(10):
        producer.send(topic, str(i).encode(), key=b"same")
    producer.flush()
    consumer = contract.bus.consumer(topic, None, "reader")
    records, deadline = [], time.monotonic() + 30
    while len(records) < 10 and time.monotonic() < deadline:
        records += consumer.poll(0.2, max_records=100)
    assert len({r.partition for r in records}) == 1
    assert [int(r.value) for r in records] == list(range(10))


def test_a_record_sent_to_a_partition_lands_there(contract):
    topic = contract.topic(3)
    producer = contract.bus.producer("p")
    assert producer.partitions(topic) == 3
    for i in range(6):
        producer.send(topic, f"v{i}".encode(), key=b"same key", partition=i % 3)
    producer.flush()
    consumer, records, deadline = contract.bus.consumer(topic, None, "reader"), [], time.monotonic() + 30
    while len(records) < 6 and time.monotonic() < deadline:
        records += consumer.poll(0.2, max_records=100)
    assert sorted((r.partition, r.value) for r in records) == sorted((i % 3, f"v{i}".encode()) for i in range(6))


def test_uncommitted_records_are_redelivered_to_the_next_member(contract):
    topic, group = contract.topic(1), contract.group()
    contract.fill(topic, 5)
    crashed = contract.bus.consumer(topic, group, "crashed")
    records, deadline = [], time.monotonic() + 30
    while len(records) < 5 and time.monotonic() < deadline:
        records += crashed.poll(0.2, max_records=5)
    crashed.commit(records[1])  # committed through offset 1; offsets 2..4 polled but not committed
    crashed.close()
    (successor,) = drain([contract.bus.consumer(topic, group, "successor")], 3)
    assert successor == [b"v2", b"v3", b"v4"]


def test_a_members_partitions_move_to_the_survivor_when_it_leaves(contract):
    topic, group = contract.topic(2), contract.group()
    leaving, staying = joined(
        contract.bus.consumer(topic, group, "leaving"), contract.bus.consumer(topic, group, "staying")
    )
    contract.fill(topic, 10)
    got_leaving, got_staying = drain([leaving, staying], 10, commit=False)
    assert got_leaving, "the leaver had partitions"
    leaving.close()  # it committed nothing: what it read comes again, to the survivor
    deadline = time.monotonic() + 60
    while set(got_staying) != set(values(10)) and time.monotonic() < deadline:
        got_staying += [r.value for r in staying.poll(0.2, max_records=100)]
    assert set(got_staying) == set(values(10))


SESSION_S = 6.0  # the consumers' session timeout on the suite's broker (kafka.session_timeout_ms, the default)


def taken_over(survivor, partitions: int, timeout_s: float = 30.0) -> tuple[float, list[bytes]]:
    """Seconds until ``survivor`` holds all ``partitions`` (polling it, as a replica does), and what it read
    meanwhile (committed)."""
    started, read = time.monotonic(), []
    while len(survivor.assigned()) < partitions:
        assert time.monotonic() - started < timeout_s, f"the survivor holds {sorted(survivor.assigned())} only"
        for record in survivor.poll(0.05, max_records=100):
            read.append(record.value)
            survivor.commit(record)
    return time.monotonic() - started, read


def test_a_member_removed_by_name_gives_its_partitions_to_the_others_at_once(contract):
    """A replica's process died (never polled nor closed again): its supervisor removes it by name, and the
    survivor holds its partitions long before the session timeout would have freed them; what the dead one read
    and did not commit comes again, to the survivor. Started again under its name, it joins as that member."""
    if not contract.names_members:
        pytest.skip("the local broker (tansu) has no static membership: kafka.static_members=false there")
    topic, group = contract.topic(4), contract.group()
    survivor, dead = joined(
        contract.bus.consumer(topic, group, "survivor", member="replica-0"),
        contract.bus.consumer(topic, group, "dead", member="replica-1"),
    )
    contract.fill(topic, 20)
    read_by_dead, deadline = [], time.monotonic() + 30
    while not read_by_dead and time.monotonic() < deadline:
        read_by_dead += dead.poll(0.2, max_records=100)
    assert read_by_dead, "the member that dies had partitions and read from them"
    assert contract.bus.remove_member("replica-1", within=group) == [group]
    seconds, read = taken_over(survivor, 4)
    assert seconds < SESSION_S / 2, "the removal, not the session timeout, freed its partitions"
    (rest,) = drain([survivor], 20 - len(read))
    assert sorted(read + rest) == sorted(values(20)), "each record to the survivor, what the dead one read included"
    assert contract.bus.remove_member("replica-1", within=group) == [], "removed once; no group holds it now"
    again = contract.bus.consumer(topic, group, "again", member="replica-1")
    joined(survivor, again)
    assert survivor.assigned() | again.assigned() == {0, 1, 2, 3} and not survivor.assigned() & again.assigned()


def test_a_named_member_that_closes_leaves_its_group_at_once(contract):
    """A member's lasting name does not keep its partitions once it closes (a replica that stops or finishes):
    Kafka's static members never leave by closing, so the bus removes it."""
    if not contract.names_members:  # names are ignored there: the dynamic leave is the test above's
        pytest.skip("the local broker (tansu) has no static membership: kafka.static_members=false there")
    topic, group = contract.topic(2), contract.group()
    staying, leaving = joined(
        contract.bus.consumer(topic, group, "staying", member="replica-0"),
        contract.bus.consumer(topic, group, "leaving", member="replica-1"),
    )
    leaving.close()
    assert taken_over(staying, 2)[0] < SESSION_S, "the member left: its session did not run out first"


def test_readers_without_a_group_read_everything_from_the_beginning_and_what_comes_after(contract):
    topic = contract.topic(4)
    contract.fill(topic, 8)
    x, y = contract.bus.consumer(topic, None, "x"), contract.bus.consumer(topic, None, "y")
    assert [sorted(got) for got in drain([x], 8)] == [sorted(values(8))]
    assert [sorted(got) for got in drain([y], 8)] == [sorted(values(8))]
    assert nothing_more(contract, x) == []
    contract.fill(topic, 1, first=8)
    assert drain([x], 1) == [[b"v8"]] and drain([y], 1) == [[b"v8"]]


def test_lag_counts_the_records_not_yet_consumed(contract):
    topic = contract.topic(1)
    contract.fill(topic, 6)
    consumer = contract.bus.consumer(topic, contract.group(), "c")
    got, deadline = [], time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        got += consumer.poll(0.5, max_records=2 - len(got))
    assert len(got) == 2 and consumer.lag() == 4


def test_a_paused_partition_is_held_back_while_the_others_flow(contract):
    topic = contract.topic(2)
    producer = contract.bus.producer("p")
    for i in range(6):
        producer.send(topic, f"v{i}".encode(), partition=i % 2)
    producer.flush()
    consumer, first, deadline = contract.bus.consumer(topic, contract.group(), "c"), [], time.monotonic() + 30
    while not first and time.monotonic() < deadline:
        first = consumer.poll(0.2, max_records=1)
    held = first[0].partition
    consumer.pause(held)
    others = [v for i, v in enumerate(values(6)) if i % 2 != held]
    (flowing,) = drain([consumer], len(others), commit=False)
    flowing += nothing_more(contract, consumer)
    assert sorted(flowing) == sorted(others), "the other partition flows; nothing of the paused one"
    consumer.resume(held)
    (rest,) = drain([consumer], 2, commit=False)
    assert sorted([first[0].value, *flowing, *rest]) == sorted(values(6)), "after resume, the held records, once each"


def test_poll_waits_for_a_record_sent_meanwhile(contract):
    topic = contract.topic(1)
    consumer = contract.bus.consumer(topic, None, "c")
    consumer.poll(0.1)  # assigned and positioned
    threading.Timer(0.3, contract.fill, args=(topic, 1)).start()
    got, deadline = [], time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        got = consumer.poll(timeout_s=5.0)
    assert [r.value for r in got] == [b"v0"]


def test_a_record_of_several_megabytes_round_trips(contract):
    topic = contract.topic(1)
    payload = uuid.uuid4().bytes * (3 * 1024 * 1024 // 16)  # 3 MiB: above every 1 MB client default
    producer = contract.bus.producer("big")
    producer.send(topic, payload)
    producer.flush()
    assert drain([contract.bus.consumer(topic, contract.group(), "c")], 1) == [[payload]]


def test_a_null_value_and_a_null_key_round_trip_as_none(contract):
    """Kafka's null value (a tombstone on a compacted topic), which any client may write on any topic."""
    topic = contract.topic(1)
    producer = contract.bus.producer("nulls")
    producer.send(topic, None, key=b"gone")
    producer.send(topic, b"", key=None)
    producer.flush()
    got = drain([contract.bus.consumer(topic, contract.group(), "c")], 2)
    assert got == [[None, b""]]


def test_the_log_identity_is_the_first_record_with_a_value_and_create_never_answers_none(contract):
    topic = contract.topic(1)
    producer = contract.bus.producer("nulls")
    producer.send(topic, None, key=b"forged", partition=0)  # a null record written before the log's identity
    producer.flush()
    made = contract.bus.log_identity(topic, create=True)
    assert made and len(made) == 32
    assert contract.bus.log_identity(topic) == made == contract.bus.log_identity(topic, create=True)
    producer.send(topic, None, key=made.encode(), partition=0)  # a tombstone of the identity's key
    producer.flush()
    assert contract.bus.log_identity(topic) == made


def test_log_identity_of_a_topic_that_does_not_exist(contract):
    from services.transport import LogMissing

    missing = f"t-{uuid.uuid4().hex[:8]}"
    assert contract.bus.log_identity(missing) is None
    if isinstance(contract.bus, MemoryBus):
        with pytest.raises(LogMissing, match=missing):
            contract.bus.log_identity(missing, create=True)
