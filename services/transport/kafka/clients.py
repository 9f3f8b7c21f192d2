"""kafka-python's producer and consumer behind the bus's :class:`~services.transport.base.Producer` and
:class:`~services.transport.base.Consumer`."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from services.transport.base import Consumer, Producer, Record
from services.transport.kafka.groups import WedgeWatch

log = logging.getLogger(__name__)


class KafkaBusProducer(Producer):
    def __init__(self, producer: KafkaProducer):
        self.producer = producer
        self.futures = []

    def send(self, topic: str, value: bytes | None, key: bytes | None = None, partition: int | None = None) -> None:
        self.futures.append(self.producer.send(topic, value=value, key=key, partition=partition))

    def partitions(self, topic: str) -> int:
        return len(self.producer.partitions_for(topic))

    def flush(self) -> None:
        self.producer.flush()
        futures, self.futures = self.futures, []
        for future in futures:
            future.get()  # raises the send's error: an unacknowledged output must not let the input be committed

    def close(self) -> None:
        self.flush()
        self.producer.close()

    def discard(self) -> None:
        self.futures = []
        sender = self.producer._sender  # kafka-python's close() flushes first, sending what is queued
        if sender is not None:
            sender.force_close()  # what is queued is failed, not sent
        try:
            self.producer.close(timeout=0)
        except KafkaError as exc:  # batches the sender has not failed yet
            log.debug("discarding a producer: %s", exc)


class KafkaBusConsumer(Consumer):
    def __init__(
        self,
        consumer: KafkaConsumer,
        topic: str,
        group: str | None,
        wedge: WedgeWatch | None = None,
        fetch_wait_s: float = 0.0,
        leave: Callable[[str], object] | None = None,
    ):
        self.consumer, self.topic, self.group, self.wedge = consumer, topic, group, wedge
        self.fetch_wait_s, self.leave = fetch_wait_s, leave
        self.buffer: list[Record] = []

    def poll(self, timeout_s: float = 0.0, max_records: int = 1) -> list[Record]:
        if self.wedge is not None:
            self.consumer = self.wedge.check(self.consumer)
            self.group = self.wedge.groups.name
        if not self.buffer:
            # Never 0 ms: with a zero timeout kafka-python can keep sending fetches without ever reading one back.
            batches = self.consumer.poll(timeout_ms=max(int(timeout_s * 1000), 10), max_records=max_records)
            for records in batches.values():
                self.buffer.extend(
                    Record(r.topic, r.partition, r.offset, r.key, r.value, r.timestamp / 1000.0) for r in records
                )
        out, self.buffer = self.buffer[:max_records], self.buffer[max_records:]
        return out

    def pause(self, partition: int) -> None:
        # Records of this partition fetched but not yet returned are fetched again after resume.
        tp = TopicPartition(self.topic, partition)
        dropped = [r.offset for r in self.buffer if r.partition == partition]
        self.buffer = [r for r in self.buffer if r.partition != partition]
        if tp in self.consumer.assignment():
            if dropped:
                self.consumer.seek(tp, min(dropped))
            self.consumer.pause(tp)

    def resume(self, partition: int) -> None:
        tp = TopicPartition(self.topic, partition)
        if tp in self.consumer.assignment():
            self.consumer.resume(tp)
            # kafka-python 3.0.12 parks a paused partition's records it had parsed (KAFKA-7548) but gives them back
            # only while no other partition's records are in line, which after the first poll is never: the
            # partition would not be fetched again. Dropping them costs one fetch from the position, which pause()
            # set to the first record not returned.
            getattr(self.consumer._fetcher, "_paused_partition_records", {}).pop(tp, None)

    def commit(self, record: Record) -> None:
        if self.group is None:
            return
        self.consumer.commit(
            {TopicPartition(record.topic, record.partition): OffsetAndMetadata(record.offset + 1, "", -1)}
        )

    def log_ends(self) -> dict[int, int]:
        ends = {tp.partition: self.consumer.highwater(tp) for tp in self.consumer.assignment()}
        return {partition: end for partition, end in ends.items() if end is not None}

    def assigned(self) -> set[int]:
        return {tp.partition for tp in self.consumer.assignment()}

    def at_end(self) -> bool:
        # An end offset is known once a fetch of the partition was answered; until then nothing says it is read.
        assigned = self.consumer.assignment()
        ends = {tp: self.consumer.highwater(tp) for tp in assigned}
        return (
            bool(assigned)
            and not self.buffer
            and all(end is not None and self.consumer.position(tp) >= end for tp, end in ends.items())
        )

    def lag(self) -> int:
        total = 0
        for tp in self.consumer.assignment():
            highwater = self.consumer.highwater(tp)
            if highwater is not None:
                total += max(highwater - self.consumer.position(tp), 0)
        return total

    def close(self) -> None:
        try:
            self.consumer.close()
            if self.leave is not None and self.group is not None:
                self.leave(self.group)
        except KafkaError as exc:
            log.warning("closing consumer: %s", exc)
