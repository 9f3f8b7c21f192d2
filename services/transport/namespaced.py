"""A run's own corner of a shared bus: its topics and consumer groups carry the run's namespace.

``<namespace>.<topic>`` and ``<namespace>.<group>`` on the bus beneath; the services above it name topics and groups
as the pipeline does (``prompts``, ``weights``, ...), and the records they read say those names. Two runs on one
cluster therefore never share a topic, a partition, a group or a compacted key.
"""

from __future__ import annotations

import dataclasses

from services.transport.base import Bus, Consumer, Producer, Record, TopicSpec

__all__ = ["NamespacedBus"]


class NamespacedBus(Bus):
    def __init__(self, bus: Bus, namespace: str):
        self.bus, self.namespace = bus, namespace
        self._prefix = f"{namespace}."

    def name(self, topic: str) -> str:
        """The topic's (or group's) name on the bus beneath."""
        return self._prefix + topic

    def local(self, name: str) -> str:
        return name.removeprefix(self._prefix)

    def create_topics(self, specs: list[TopicSpec], replace_wrong: bool = False) -> None:
        self.bus.create_topics([dataclasses.replace(spec, name=self.name(spec.name)) for spec in specs], replace_wrong)

    def log_identity(self, topic: str, create: bool = False) -> str | None:
        return self.bus.log_identity(self.name(topic), create)

    def replication(self, topics: list[str]) -> tuple[int, dict[str, int]]:
        brokers, copies = self.bus.replication([self.name(topic) for topic in topics])
        return brokers, {self.local(name): count for name, count in copies.items()}

    def producer(self, client_id: str) -> Producer:
        return _Producer(self.bus.producer(client_id), self)

    def consumer(self, topic: str, group: str | None, client_id: str, member: str | None = None) -> Consumer:
        group = self.name(group) if group is not None else None
        return _Consumer(self.bus.consumer(self.name(topic), group, client_id, member), self)

    def remove_member(self, member: str, within: str = "") -> list[str]:
        """Of this run's groups only: a replica's name is its own within a run, not across runs."""
        return [self.local(group) for group in self.bus.remove_member(member, within=self.name(within))]

    def close(self) -> None:
        self.bus.close()


class _Producer(Producer):
    def __init__(self, producer: Producer, bus: NamespacedBus):
        self.producer, self.bus = producer, bus

    def send(self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None) -> None:
        self.producer.send(self.bus.name(topic), value, key=key, partition=partition)

    def partitions(self, topic: str) -> int:
        return self.producer.partitions(self.bus.name(topic))

    def flush(self) -> None:
        self.producer.flush()

    def close(self) -> None:
        self.producer.close()

    def discard(self) -> None:
        self.producer.discard()


class _Consumer(Consumer):
    def __init__(self, consumer: Consumer, bus: NamespacedBus):
        self.consumer, self.bus = consumer, bus
        self.fetch_wait_s = consumer.fetch_wait_s

    def poll(self, timeout_s: float = 0.0, max_records: int = 1) -> list[Record]:
        records = self.consumer.poll(timeout_s, max_records)
        return [dataclasses.replace(record, topic=self.bus.local(record.topic)) for record in records]

    def commit(self, record: Record) -> None:
        self.consumer.commit(dataclasses.replace(record, topic=self.bus.name(record.topic)))

    def pause(self, partition: int) -> None:
        self.consumer.pause(partition)

    def resume(self, partition: int) -> None:
        self.consumer.resume(partition)

    def lag(self) -> int:
        return self.consumer.lag()

    def log_ends(self) -> dict[int, int]:
        return self.consumer.log_ends()

    def assigned(self) -> set[int]:
        return self.consumer.assigned()

    def close(self) -> None:
        self.consumer.close()
