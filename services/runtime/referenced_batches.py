"""Batches that travel by reference: both sides of :mod:`common.batch_store` for one replica.

On the way out, a batch whose encoding exceeds ``pipeline.inline_max_bytes`` is written to the run's batch store and
its topic carries a :class:`~common.schema.BatchReference`. On the way in, a reference is resolved to the batch it
names (digest checked) and remembered with its record's offset; once the replica's group commits past that record,
its file may go, since its content lives on in the outputs made from it (or, for the learner, in its checkpoint):
it is removed then with ``kafka.retention.remove_committed_batches``, else kept as long as its record is
(:meth:`~common.batch_store.BatchStore.expire`), so the log stays whole. A reference that is dead-lettered keeps its
file, for inspection.
"""

from __future__ import annotations

from common.batch_store import BatchStore
from common.schema import BatchReference, Message, SchemaError, decode
from services.transport import Record

__all__ = ["ReferencedBatches"]


class ReferencedBatches:
    def __init__(self, store: BatchStore, inline_max_bytes: int, remove_committed: bool = False):
        self.store, self.inline_max_bytes, self.remove_committed = store, inline_max_bytes, remove_committed
        self.read: dict[int, list[tuple[int, BatchReference]]] = {}  # per partition: (offset, reference)

    def record_value(self, message: Message) -> tuple[bytes, bool]:
        """What the topic carries for ``message``, and whether that is a reference to a stored file."""
        return self.store.record_value(message, self.inline_max_bytes)

    def fetch(self, record: Record, reference: BatchReference, expected: type) -> Message:
        """The batch ``reference`` (read from ``record``) names, decoded as ``expected``; raises
        :class:`~common.schema.SchemaError` or :class:`~common.batch_store.BatchStoreError`."""
        if reference.carries != expected.SCHEMA:
            raise SchemaError(f"a reference to a {reference.carries!r} message on {record.topic}")
        message = decode(self.store.get(reference), expected=expected)
        self.read.setdefault(record.partition, []).append((record.offset, reference))
        return message

    def keep(self, record: Record) -> None:
        """The batch of ``record`` was dead-lettered: its file stays, named by the dead letter's payload."""
        kept = self.read.get(record.partition, [])
        self.read[record.partition] = [(offset, ref) for offset, ref in kept if offset != record.offset]

    def release(self, committed: Record) -> None:
        """Forget the batches read up to ``committed``, which the group has now committed past; with
        ``remove_committed``, remove their files."""
        if not self.remove_committed:
            self.read.pop(committed.partition, None)
            return
        kept = []
        for offset, reference in self.read.pop(committed.partition, []):
            if offset <= committed.offset:
                self.store.remove(reference)
            else:
                kept.append((offset, reference))
        if kept:
            self.read[committed.partition] = kept
