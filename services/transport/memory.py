"""An in-memory bus with Kafka's semantics, for the embedded run and for tests of the pipeline's logic."""

from __future__ import annotations

import threading
import time
import uuid
import zlib
from collections import defaultdict

from services.transport.base import Bus, Consumer, LogMissing, Producer, Record, TopicSpec

__all__ = ["MemoryBus"]


class _Topic:
    def __init__(self, spec: TopicSpec):
        self.spec = spec
        self.partitions: list[list[Record]] = [[] for _ in range(spec.partitions)]


class MemoryBus(Bus):
    """Thread-safe; records live as long as the bus. Consumers of a group split partitions by range."""

    def __init__(self):
        self._lock = threading.Condition()
        self._topics: dict[str, _Topic] = {}
        self._committed: dict[tuple[str, str, int], int] = {}  # (group, topic, partition) -> next offset
        self._members: dict[tuple[str, str], list[str]] = defaultdict(list)  # (group, topic) -> member ids
        self._generation: dict[tuple[str, str], int] = defaultdict(int)
        self._round_robin = 0

    def create_topics(self, specs: list[TopicSpec], replace_wrong: bool = False) -> None:
        with self._lock:
            for spec in specs:
                self._topics.setdefault(spec.name, _Topic(spec))

    def topic(self, name: str) -> _Topic:
        try:
            return self._topics[name]
        except KeyError:
            raise KeyError(f"topic {name!r} does not exist") from None

    def log_identity(self, topic: str, create: bool = False) -> str | None:
        with self._lock:
            if topic not in self._topics:
                if create:
                    raise LogMissing(f"topic {topic} does not exist: the run's topics were not made")
                return None
            log = [record for record in self._topics[topic].partitions[0] if record.value is not None]
            if not log and create:
                identity = uuid.uuid4().hex
                self._append(topic, identity.encode(), None, 0)
                return identity
            return log[0].value.decode(errors="replace") if log else None

    def producer(self, client_id: str) -> Producer:
        return _MemoryProducer(self)

    def consumer(self, topic: str, group: str | None, client_id: str, member: str | None = None) -> Consumer:
        return _MemoryConsumer(self, topic, group, client_id, member)

    def remove_member(self, member: str, within: str = "") -> list[str]:
        removed = []
        with self._lock:
            for (group, topic), members in self._members.items():
                if group.startswith(within) and member in members:
                    self._leave(group, topic, member)
                    removed.append(group)
        return removed

    # -- used by producers and consumers, under the lock

    def _append(self, topic: str, value: bytes | None, key: bytes | None, partition: int | None = None) -> None:
        with self._lock:
            t = self.topic(topic)
            if partition is not None:
                if not 0 <= partition < len(t.partitions):
                    raise ValueError(f"{topic} has no partition {partition} (it has {len(t.partitions)})")
            elif key is not None:
                partition = zlib.crc32(key) % len(t.partitions)
            else:
                partition = self._round_robin % len(t.partitions)
                self._round_robin += 1
            log = t.partitions[partition]
            log.append(Record(topic, partition, len(log), key, None if value is None else bytes(value), time.time()))
            self._lock.notify_all()

    def _join(self, group: str, topic: str, member: str) -> None:
        with self._lock:
            self._members[(group, topic)].append(member)
            self._generation[(group, topic)] += 1

    def _leave(self, group: str, topic: str, member: str) -> None:
        with self._lock:
            members = self._members[(group, topic)]
            if member in members:
                members.remove(member)
                self._generation[(group, topic)] += 1

    def _assignment(self, group: str, topic: str, member: str) -> list[int]:
        members = sorted(self._members[(group, topic)])
        count = len(self.topic(topic).partitions)
        rank = members.index(member)
        return [p for p in range(count) if p % len(members) == rank]


class _MemoryProducer(Producer):
    def __init__(self, bus: MemoryBus):
        self.bus = bus

    def send(self, topic: str, value: bytes | None, key: bytes | None = None, partition: int | None = None) -> None:
        self.bus._append(topic, value, key, partition)

    def partitions(self, topic: str) -> int:
        return len(self.bus.topic(topic).partitions)

    def flush(self) -> None:
        pass  # appends are synchronous


class _MemoryConsumer(Consumer):
    _ids = 0

    def __init__(self, bus: MemoryBus, topic: str, group: str | None, client_id: str, member: str | None = None):
        self.bus, self.topic, self.group = bus, topic, group
        _MemoryConsumer._ids += 1
        self.member = member or f"{client_id}-{_MemoryConsumer._ids}"
        self.positions: dict[int, int] = {}
        self.paused: set[int] = set()
        self.generation = -1
        self.closed = False
        with bus._lock:
            t = bus.topic(topic)
            if group is None:
                self.positions = {p: 0 for p in range(len(t.partitions))}
            else:
                bus._join(group, topic, self.member)

    def _sync_assignment(self) -> None:
        """After a membership change, take the new share of partitions from their committed offsets."""
        if self.group is None:
            return
        if not self.closed and self.member not in self.bus._members[(self.group, self.topic)]:
            self.bus._join(self.group, self.topic, self.member)  # removed while alive: it joins again, as in Kafka
        generation = self.bus._generation[(self.group, self.topic)]
        if generation == self.generation:
            return
        self.generation = generation
        self.positions = {}
        self.paused = set()  # as in Kafka, a rebalance forgets pauses
        for p in self.bus._assignment(self.group, self.topic, self.member):
            self.positions[p] = self.bus._committed.get((self.group, self.topic, p), 0)

    def poll(self, timeout_s: float = 0.0, max_records: int = 1) -> list[Record]:
        deadline = time.monotonic() + timeout_s
        with self.bus._lock:
            while True:
                self._sync_assignment()
                logs = self.bus.topic(self.topic).partitions
                out: list[Record] = []
                for p in sorted(set(self.positions) - self.paused):
                    while len(out) < max_records and self.positions[p] < len(logs[p]):
                        out.append(logs[p][self.positions[p]])
                        self.positions[p] += 1
                remaining = deadline - time.monotonic()
                if out or remaining <= 0:
                    return out
                self.bus._lock.wait(remaining)

    def commit(self, record: Record) -> None:
        if self.group is None:
            return
        with self.bus._lock:
            key = (self.group, record.topic, record.partition)
            self.bus._committed[key] = max(self.bus._committed.get(key, 0), record.offset + 1)

    def pause(self, partition: int) -> None:
        with self.bus._lock:
            self.paused.add(partition)

    def resume(self, partition: int) -> None:
        with self.bus._lock:
            self.paused.discard(partition)

    def log_ends(self) -> dict[int, int]:
        with self.bus._lock:
            self._sync_assignment()
            logs = self.bus.topic(self.topic).partitions
            return {p: len(logs[p]) for p in self.positions}

    def assigned(self) -> set[int]:
        with self.bus._lock:
            self._sync_assignment()
            return set(self.positions)

    def lag(self) -> int:
        with self.bus._lock:
            self._sync_assignment()
            logs = self.bus.topic(self.topic).partitions
            return sum(len(logs[p]) - pos for p, pos in self.positions.items())

    def close(self) -> None:
        if not self.closed and self.group is not None:
            self.bus._leave(self.group, self.topic, self.member)
        self.closed = True
