"""Transports behind one interface: :class:`MemoryBus` here, Kafka next to it."""

from services.transport.base import (
    Bus,
    Consumer,
    LogMissing,
    LogReplaced,
    Producer,
    Record,
    TopicMismatch,
    TopicSpec,
    dlq_topic,
)
from services.transport.memory import MemoryBus

__all__ = [
    "Bus",
    "Consumer",
    "LogMissing",
    "LogReplaced",
    "MemoryBus",
    "Producer",
    "Record",
    "TopicMismatch",
    "TopicSpec",
    "dlq_topic",
]
