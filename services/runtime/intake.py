"""What a replica takes in, and what it sets aside: records decoded and checked, bad ones dead-lettered.

A record that fails to decode or validate, is unsigned in a signed run, or carries a null value on a topic that is
not compacted goes to ``<topic>.dlq`` with the error and its source offset: bad input never stops a service and is
never silently dropped. Another run's message is skipped and counted; a tombstone on a compacted topic is counted.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import blake3

from common.batch_store import BatchStoreError
from common.schema import RUN_ID, BatchReference, DeadLetter, Message, SchemaError, decode, encode
from common.signing import Signer
from services.roles import COMPACTED_TOPICS
from services.runtime.referenced_batches import ReferencedBatches
from services.service import Service
from services.transport import Producer, Record, dlq_topic

log = logging.getLogger(__name__)

__all__ = ["DEAD_LETTER_FIELDS_BYTES", "DEAD_LETTER_KEY_BYTES", "Intake"]

# A dead letter's fields but its payload (error, topic, key, record overhead): what the largest record leaves room for.
DEAD_LETTER_FIELDS_BYTES = 64 * 1024
DEAD_LETTER_KEY_BYTES = 1024  # a source key past this is cut: keys name a batch, a replica or a model


class Intake:
    """Decodes and checks one replica's records (:meth:`accept`) and sets aside what it cannot take
    (:meth:`dead_letter`). ``count(outcome)`` counts a dead letter or another run's message."""

    def __init__(
        self,
        service: Service,
        producer: Producer,
        referenced: ReferencedBatches,
        signer: Signer | None,
        counters: Counter[str],
        count: Callable[[str], None],
    ):
        self.service, self.replica_id, self.producer = service, service.replica_id, producer
        self.referenced, self.signer, self.counters, self.count = referenced, signer, counters, count

    def accept(self, record: Record, expected: type) -> Message | None:
        """``record`` decoded as ``expected`` (a batch sent by reference, fetched), if it is valid and of this run.

        What does not decode or validate is dead-lettered, another run's message skipped and counted, a tombstone
        (a null value on a compacted topic: the deletion of its key's record, which a reader that has taken the
        record in has nothing to undo of) counted: None for each, and the caller commits past the record (a group's
        input) or not (the weights feed's).
        """
        if record.value is None and record.topic not in COMPACTED_TOPICS:
            why = f"a record with a null value (a tombstone) on {record.topic}, which is not compacted"
            self.set_aside(record, why)
            return None
        if record.value is None:
            self.counters["tombstones"] += 1
            log.info(
                "%s: %s[%d]@%d is a tombstone (key %r): nothing to take",
                self.replica_id,
                record.topic,
                record.partition,
                record.offset,
                record.key,
            )
            return None
        try:
            message = decode(record.value, expected=(expected, BatchReference))
            if isinstance(message, BatchReference):
                message = self.referenced.fetch(record, message, expected)
        except (SchemaError, BatchStoreError) as exc:
            self.set_aside(record, str(exc))
            return None
        if self.signer is not None and not self.signer.verify(message):
            self.counters["unsigned"] += 1
            self.set_aside(record, f"{message.SCHEMA} {message.batch_id} is unsigned or signed with another key")
            return None
        if message.lineage.get(RUN_ID) != self.service.run_id:
            self.count("other_run")
            log.warning(
                "%s: skipping %s %s of run %r (this is run %r)",
                self.replica_id,
                message.SCHEMA,
                message.batch_id,
                message.lineage.get(RUN_ID),
                self.service.run_id,
            )
            return None
        return message

    def set_aside(self, record: Record, error: str) -> None:
        """Dead-letter an input record (see :meth:`dead_letter`); a batch it references keeps its file."""
        self.dead_letter(record.topic, record.value, record.key, error, record.partition, record.offset)
        self.referenced.keep(record)

    def dead_letter(
        self, topic: str, payload: bytes | None, key: bytes | None, error: str, partition: int = -1, offset: int = -1
    ) -> None:
        """The one place a record is set aside: ``payload`` of ``topic`` (at ``partition``/``offset``, or -1 for a
        message that never was a record, such as a channel's) on ``<topic>.dlq`` with why, counted and said."""
        payload, key, error = self._fit(payload, key, error)
        letter = DeadLetter(
            error=error,
            source_topic=topic,
            source_partition=partition,
            source_offset=offset,
            payload=payload,
            producer=self.replica_id,
            created_at=time.time(),
        )
        self.producer.send(dlq_topic(topic), encode(letter), key=key)
        self.producer.flush()
        self.count("dead_letter")
        where = f"{topic}[{partition}]@{offset}" if partition >= 0 else f"a record of {topic}"
        log.warning("%s: %s sent to %s: %s", self.replica_id, where, dlq_topic(topic), error)

    def _fit(self, payload: bytes | None, key: bytes | None, error: str) -> tuple[bytes, bytes | None, str]:
        """What a dead letter can carry of whatever came in, and the error saying what it could not: a null value as
        no bytes; a payload or key too large for a record beside the letter's other fields, cut (the payload's whole
        size and digest said). A dead letter that could not be sent would stop the replica at every restart."""
        payload = payload if payload is not None else b""
        room = self.service.config.kafka.max_message_bytes - DEAD_LETTER_FIELDS_BYTES
        if len(payload) > room:
            error = (
                f"{error} (payload cut to its first {room} of {len(payload)} bytes; whole: "
                f"blake3:{blake3.blake3(payload).hexdigest()})"
            )
            payload = payload[:room]
        if key is not None and len(key) > DEAD_LETTER_KEY_BYTES:
            key, error = key[:DEAD_LETTER_KEY_BYTES], f"{error} (key cut to its first {DEAD_LETTER_KEY_BYTES} bytes)"
        return payload, key, error
