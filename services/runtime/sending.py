"""How a replica's outputs go out: each signed (a signed run), encoded (a batch too large for a record by
reference), then all sent and flushed. One that cannot be encoded raises :class:`OutputError` before anything is
sent."""

from __future__ import annotations

from collections import Counter

from common.schema import Message, SchemaError, message_key, message_partition
from common.signing import Signer
from services.runtime.referenced_batches import ReferencedBatches
from services.transport import Producer

__all__ = ["OutputError", "Sender"]


class OutputError(Exception):
    """A service's output that cannot be encoded (a value the schema refuses): nothing of the outputs is sent, and
    the input they came from is dead-lettered with why. Sent anyway, it would fail the same way at every restart."""


class Sender:
    """Sends one replica's messages on its producer (``default_topic``: the service's output topic)."""

    def __init__(
        self,
        producer: Producer,
        referenced: ReferencedBatches,
        signer: Signer | None,
        counters: Counter[str],
        default_topic: str | None,
    ):
        self.producer, self.referenced, self.signer = producer, referenced, signer
        self.counters, self.default_topic = counters, default_topic

    def send(self, messages: list[Message], topic: str | None = None) -> None:
        topic = topic or self.default_topic
        encoded = []
        for message in messages:
            if self.signer is not None:
                self.signer.sign(message)
            try:
                payload, by_reference = self.referenced.record_value(message)
            except SchemaError as exc:
                raise OutputError(f"its output {message.SCHEMA} {message.batch_id} cannot be encoded: {exc}") from exc
            encoded.append((message, payload, by_reference))
        for message, payload, by_reference in encoded:
            self.counters["sent_by_reference"] += by_reference
            partition = message_partition(message, self.producer.partitions(topic))
            self.producer.send(topic, payload, key=message_key(message), partition=partition)
        self.producer.flush()
