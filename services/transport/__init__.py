"""Transports behind one interface: :class:`MemoryBus` here, Kafka next to it."""

from services.transport.base import Bus, Consumer, Producer, Record, TopicMismatch, TopicSpec, dlq_topic
from services.transport.memory import MemoryBus

__all__ = ["Bus", "Consumer", "MemoryBus", "Producer", "Record", "TopicMismatch", "TopicSpec", "dlq_topic"]
