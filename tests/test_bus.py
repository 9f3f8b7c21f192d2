"""The in-memory bus keeps Kafka's semantics: groups, shared partitions, commits, re-delivery, broadcast."""

from services.transport import MemoryBus, TopicSpec


def make_bus(partitions=4):
    bus = MemoryBus()
    bus.create_topics([TopicSpec("t", partitions)])
    return bus


def fill(bus, count):
    producer = bus.producer("p")
    for i in range(count):
        producer.send("t", f"v{i}".encode(), key=f"k{i}".encode())
    producer.flush()


def drain(consumer, commit=True):
    seen = []
    while records := consumer.poll(0.0, max_records=100):
        for record in records:
            seen.append(record.value)
            if commit:
                consumer.commit(record)
    return seen


def test_every_group_sees_every_record():
    bus = make_bus()
    fill(bus, 20)
    a, b = bus.consumer("t", "group-a", "a"), bus.consumer("t", "group-b", "b")
    assert sorted(drain(a)) == sorted(drain(b)) == sorted(f"v{i}".encode() for i in range(20))


def test_members_of_a_group_share_the_partitions():
    bus = make_bus()
    fill(bus, 40)
    first, second = bus.consumer("t", "g", "r1"), bus.consumer("t", "g", "r2")
    one, two = drain(first), drain(second)
    assert one and two and not set(one) & set(two)
    assert len(one) + len(two) == 40


def test_same_key_same_partition_in_order():
    bus = make_bus()
    producer = bus.producer("p")
    for i in range(10):
        producer.send("t", str(i).encode(), key=b"same")
    records = bus.consumer("t", "g", "c").poll(0.0, max_records=100)
    assert len({r.partition for r in records}) == 1
    assert [int(r.value) for r in records] == list(range(10))


def test_uncommitted_records_are_redelivered_after_a_member_leaves():
    bus = make_bus(partitions=1)
    fill(bus, 5)
    crashed = bus.consumer("t", "g", "c1")
    records = crashed.poll(0.0, max_records=5)
    crashed.commit(records[1])  # committed through offset 1; offsets 2..4 polled but not committed
    crashed.close()
    successor = bus.consumer("t", "g", "c2")
    assert drain(successor) == [b"v2", b"v3", b"v4"]


def test_rebalance_moves_partitions_to_the_survivor():
    bus = make_bus(partitions=2)
    a, b = bus.consumer("t", "g", "a"), bus.consumer("t", "g", "b")
    fill(bus, 10)
    from_a = drain(a, commit=False)  # a's share, never committed
    a.close()
    from_b = drain(b)
    assert set(from_a) <= set(from_b) and len(from_b) == 10


def test_broadcast_consumers_read_everything_without_a_group():
    bus = make_bus()
    fill(bus, 8)
    x, y = bus.consumer("t", None, "x"), bus.consumer("t", None, "y")
    assert len(drain(x)) == len(drain(y)) == 8
    late = bus.consumer("t", None, "late", from_beginning=False)
    assert drain(late) == []
    fill(bus, 1)
    assert drain(late) == [b"v0"]


def test_lag_counts_unconsumed_records():
    bus = make_bus(partitions=1)
    consumer = bus.consumer("t", "g", "c")
    fill(bus, 6)
    assert consumer.lag() == 6
    consumer.poll(0.0, max_records=4)
    assert consumer.lag() == 2


def test_poll_waits_for_a_record_from_another_thread():
    import threading

    bus = make_bus(partitions=1)
    consumer = bus.consumer("t", "g", "c")
    threading.Timer(0.05, fill, args=(bus, 1)).start()
    assert [r.value for r in consumer.poll(timeout_s=5.0)] == [b"v0"]
