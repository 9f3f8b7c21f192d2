"""One way to read a run's log, whether a broker holds it or an archive folder does.

A :class:`LogReader` yields every record of a topic from the start, and its messages decoded, each batch that
travelled by reference fetched from the batch store (or the archive's copy) with its digest checked. A record
that cannot be decoded is counted in :attr:`LogReader.unreadable` with why, and skipped: a tool over the log says
what it could not read rather than stop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from common.batch_store import BatchStore, BatchStoreError
from common.log_archive import ArchivedRecord, LogArchive
from common.schema import TOPIC_MESSAGE, BatchReference, SchemaError, decode
from services.transport.base import Bus, Record

__all__ = ["ArchiveReader", "BusReader", "LogReader", "Unreadable", "topic_of"]


def topic_of(message_type: type) -> str:
    """The pipeline topic that carries ``message_type`` (``common.schema.TOPIC_MESSAGE``)."""
    return next(topic for topic, cls in TOPIC_MESSAGE.items() if cls is message_type)


@dataclass(frozen=True)
class Unreadable:
    topic: str
    partition: int
    offset: int
    error: str


@dataclass
class LogReader:
    """Base of both readers: :meth:`records` is theirs, decoding is shared."""

    unreadable: list[Unreadable] = field(default_factory=list, init=False)

    def records(self, topic: str) -> Iterator[ArchivedRecord]:
        raise NotImplementedError

    def batch_file(self, reference: BatchReference) -> BatchReference:
        """The reference as this reader can open it (an archive keeps its own copy of each file)."""
        return reference

    def messages(self, message_type: type) -> Iterator[tuple[ArchivedRecord, object]]:
        """Each record of ``message_type``'s topic with its message, references resolved."""
        for record in self.records(topic_of(message_type)):
            try:
                message = decode(record.value, expected=(message_type, BatchReference))
                if isinstance(message, BatchReference):
                    if message.carries != message_type.SCHEMA:
                        raise SchemaError(f"a reference to a {message.carries!r} message")
                    message = decode(BatchStore.get(self.batch_file(message)), expected=message_type)
            except (SchemaError, BatchStoreError) as exc:
                self.unreadable.append(Unreadable(record.topic, record.partition, record.offset, str(exc)))
                continue
            yield record, message


@dataclass
class ArchiveReader(LogReader):
    archive: LogArchive = None  # type: ignore[assignment]

    @classmethod
    def open(cls, root: Path) -> ArchiveReader:
        return cls(archive=LogArchive(root))

    def records(self, topic: str) -> Iterator[ArchivedRecord]:
        return self.archive.records(topic)

    def batch_file(self, reference: BatchReference) -> BatchReference:
        kept = self.archive.batch_file(reference.uri)
        return dataclasses.replace(reference, uri=str(kept)) if kept.exists() else reference


@dataclass
class BusReader(LogReader):
    """Reads a topic with no consumer group (all partitions, from the beginning) up to the ends it finds."""

    bus: Bus = None  # type: ignore[assignment]
    partitions: dict[str, int] = field(default_factory=dict)  # topic -> partitions it has
    idle_s: float = 10.0  # a partition whose end is still unknown after this long counts as empty

    def records(self, topic: str) -> Iterator[Record]:
        consumer = self.bus.consumer(topic, None, "streamppo-log-reader")
        expected = self.partitions.get(topic, 1)
        try:
            last_record = time.monotonic()
            while True:
                batch = consumer.poll(timeout_s=0.5, max_records=500)
                yield from batch  # transport Records: the fields of an ArchivedRecord, as the archive writes them
                if batch:
                    last_record = time.monotonic()
                    continue
                ends_known = len(consumer.log_ends()) >= expected
                if consumer.lag() == 0 and (ends_known or time.monotonic() - last_record > self.idle_s):
                    return
        finally:
            consumer.close()
