"""The bus interface every service talks to, shaped after Kafka's semantics.

- A topic has partitions; a record's key picks its partition, so one key's records stay in order.
- A consumer in a *group* shares the topic's partitions with the other members of that group; every group
  sees every record. A consumer with ``group=None`` reads all partitions on its own (used for broadcast
  streams such as weight announcements, which every replica must see).
- Positions advance on ``poll``; ``commit`` makes them durable for the group. After a rebalance or a restart a
  member resumes from the last commit, so anything polled but not committed is delivered again
  (at-least-once; consumers make re-delivery harmless by de-duplicating on ``batch_id``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

__all__ = [
    "Bus",
    "Consumer",
    "LogMissing",
    "LogReplaced",
    "Producer",
    "Record",
    "TopicMismatch",
    "TopicSpec",
    "dlq_topic",
]


class TopicMismatch(RuntimeError):
    """An existing topic is not what the pipeline needs (e.g. a weights topic that is not compacted)."""


class LogReplaced(RuntimeError):
    """The log a service works on is gone: the broker lost its data, or its topics were made again by another run
    start. Nothing more may be read, sent or committed; the run resumes from the learner's checkpoint."""


class LogMissing(RuntimeError):
    """The topic of the log's identity does not exist, and a caller that would make the log's identity cannot: the
    run's topics were never made, or the broker lost them."""


def dlq_topic(topic: str) -> str:
    """Name of the dead-letter topic for ``topic``."""
    return f"{topic}.dlq"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int = 1
    compacted: bool = False
    verify: bool = False  # refuse an existing topic whose partitions or compaction differ from these
    retention_ms: int | None = None  # None: the broker's default; -1: for good
    retention_bytes: int | None = None  # per partition
    settings: tuple[tuple[str, str], ...] = ()  # more topic configs, as Kafka names them (segment.ms, ...)


@dataclass(frozen=True)
class Record:
    """One record as the broker holds it. ``value`` is None for Kafka's null value: a tombstone on a compacted topic
    (the deletion of its key's record), and a record any client may write on any other topic."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: float


class Producer(ABC):
    @abstractmethod
    def send(self, topic: str, value: bytes | None, key: bytes | None = None, partition: int | None = None) -> None:
        """Queue a record (``value`` None: a null value, a tombstone), to ``partition`` or else the one its key
        hashes to; :meth:`flush` returns once everything queued is acknowledged."""

    @abstractmethod
    def partitions(self, topic: str) -> int:
        """How many partitions ``topic`` has."""

    @abstractmethod
    def flush(self) -> None: ...

    def close(self) -> None:
        self.flush()

    def discard(self) -> None:
        """Close without sending what is queued: the log it was meant for is gone (:class:`LogReplaced`), and a
        record sent now could land on the log that took its place."""


class Consumer(ABC):
    # The longest the broker holds a fetch that finds nothing: a poll that waits longer than twice this has read
    # from a fetch that began after the poll did (what a reader that must be caught up waits for).
    fetch_wait_s: float = 0.0

    @abstractmethod
    def poll(self, timeout_s: float = 0.0, max_records: int = 1) -> list[Record]:
        """Up to ``max_records`` records from the assigned partitions, waiting at most ``timeout_s``."""

    @abstractmethod
    def commit(self, record: Record) -> None:
        """Make ``record`` and everything before it in its partition durable as consumed by the group."""

    @abstractmethod
    def pause(self, partition: int) -> None:
        """Stop fetching from ``partition`` (while a record from it is held); polling goes on for the others."""

    @abstractmethod
    def resume(self, partition: int) -> None: ...

    @abstractmethod
    def lag(self) -> int:
        """Records in the assigned partitions not yet consumed by this member."""

    def log_ends(self) -> dict[int, int]:
        """The end offset last seen of each assigned partition (those seen so far)."""
        return {}

    def assigned(self) -> set[int]:
        """The partitions this member holds now (every partition for a reader without a group)."""
        return set()

    def at_end(self) -> bool:
        """Whether every assigned partition has been read to the end the broker last told of (False while an end is
        not known yet, or records are fetched but not yet returned)."""
        return self.lag() == 0

    def read_to_end(self, max_records: int) -> tuple[list[Record], bool]:
        """One poll long enough to take in a fetch that began after it (the broker holds an empty fetch for
        ``fetch_wait_s``): the records it brought, and whether it brought none and nothing is left, so that
        everything written before the call has been read."""
        records = self.poll(2 * self.fetch_wait_s + 0.05 if self.fetch_wait_s else 0.0, max_records)
        return records, not records and self.at_end()

    def close(self) -> None:
        pass


class Bus(ABC):
    @abstractmethod
    def create_topics(self, specs: list[TopicSpec], replace_wrong: bool = False) -> None:
        """Create the topics that do not exist yet. An existing topic to ``verify`` that does not match its spec is
        deleted and created again with ``replace_wrong``, else refused (:class:`TopicMismatch`); the others are
        left as they are."""

    @abstractmethod
    def log_identity(self, topic: str, create: bool = False) -> str | None:
        """The identity of the log: the value of the first record of ``topic`` (one partition) that has a value,
        which ``create=True`` writes, a new one, when there is none. None when the topic does not exist or holds no
        identity (a broker that lost its data), never with ``create=True``: it raises :class:`LogMissing` when the
        topic does not exist (it waits for a topic made a moment ago to be known). Everyone reads the first record,
        so writers that race agree on it."""

    def replication(self, topics: list[str]) -> tuple[int, dict[str, int]]:
        """The brokers the bus has, and of ``topics`` that exist the copies each keeps of its partitions (the fewest of
        any partition): what ``streamppo topics`` and ``status`` say, and warn of on a cluster of several brokers."""
        return 1, dict.fromkeys(topics, 1)

    @abstractmethod
    def producer(self, client_id: str) -> Producer: ...

    @abstractmethod
    def consumer(self, topic: str, group: str | None, client_id: str, member: str | None = None) -> Consumer:
        """A consumer of ``topic`` in ``group`` (None: all partitions, no group), from the beginning of what the
        group has not committed. Clients never make topics on their own: a topic that does not exist (on a broker
        that lost its data) is not made by reading or writing it.

        ``member``: the consumer's lasting name in its group (a replica's id), which a consumer started again under
        it takes up, and by which :meth:`remove_member` takes its partitions from it. A named member that closes
        leaves the group as any other does."""

    def remove_member(self, member: str, within: str = "") -> list[str]:
        """Take the partitions of the consumers named ``member`` from every group they are in (of the groups whose
        names begin with ``within``), at once: their process died (the supervisor that saw it says so), and the
        group would otherwise wait for the session timeout before the others get them. The groups it was removed
        from."""
        return []

    def close(self) -> None:
        pass
