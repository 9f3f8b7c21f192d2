"""What every service shares: consume → decode → core → encode → produce → commit, with a dead-letter topic.

A :class:`Service` is the thin adapter around a core in ``common/``; a :class:`ServiceRunner` moves records for
it. The runner is the only place that touches the bus, and the only place that decides delivery:

- a record that fails to decode or validate goes to ``<topic>.dlq`` with the error and its source offset, and is
  committed past: bad input never stops a service and is never silently dropped;
- outputs are produced and flushed *before* the input is committed (at-least-once);
- a batch id already handled by this replica is committed past without being processed again;
- weight announcements are read by every replica (no group), newest version per model.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from collections import Counter, OrderedDict

from common.schema import (
    RUN_ID,
    TOPIC_MESSAGE,
    DeadLetter,
    Message,
    SchemaError,
    WeightAnnouncement,
    decode,
    encode,
    message_key,
)
from common.weights import WeightIntegrityError
from services.metrics import ServiceMetrics
from services.transport import Bus, Consumer, Record, TopicSpec, dlq_topic

log = logging.getLogger(__name__)

__all__ = [
    "InputError", "PIPELINE_TOPICS", "Service", "ServiceRunner", "check_token_ids", "load_announced_weights",
    "pipeline_topics",
]

PIPELINE_TOPICS = ("prompts", "rollouts", "scored", "experience", "weights")


def pipeline_topics(partitions: int = 1) -> list[TopicSpec]:
    """Every topic the pipeline uses, with its dead-letter topic; ``weights`` is compacted."""
    specs = []
    for name in PIPELINE_TOPICS:
        specs.append(TopicSpec(name, 1 if name == "weights" else partitions, compacted=name == "weights"))
        specs.append(TopicSpec(dlq_topic(name), 1))
    return specs


class InputError(ValueError):
    """A message that decoded but cannot be processed (e.g. token ids outside the model's vocabulary)."""


def check_token_ids(message: Message, model, role: str) -> None:
    """Reject token ids the model's embedding cannot look up (the schema only knows they are non-negative).

    ``model`` may be a meta-device skeleton: only its embedding's size is read.
    """
    vocab = model.get_input_embeddings().num_embeddings
    for name in ("prompt_tokens", "response_tokens"):
        array = getattr(message, name, None)
        if array is not None and array.size and int(array.max()) >= vocab:
            raise InputError(f"{name} holds id {int(array.max())}, outside the {role}'s vocabulary of {vocab}")


def load_announced_weights(load, announcement: WeightAnnouncement, replica_id: str, current_version: int) -> bool:
    """Load an announced snapshot with ``load(uri, sha256)``; a damaged one is refused and the current weights kept.

    ``load`` raises :class:`WeightIntegrityError` for a snapshot it refuses (a sampler's ``load_snapshot``, or
    :func:`common.weights.load_snapshot_into` bound to a module).
    """
    try:
        load(announcement.uri, announcement.sha256)
    except WeightIntegrityError as exc:
        log.error("%s: keeping %s v%d: %s", replica_id, announcement.model, current_version, exc)
        return False
    log.info("%s: %s weights v%d loaded", replica_id, announcement.model, announcement.policy_version)
    return True


class Service(ABC):
    run_id: str = ""  # messages whose lineage names another run are skipped (topics may outlive a run)
    role: str = ""
    input_topic: str = ""
    output_topic: str = ""
    weight_models: tuple[str, ...] = ()  # the models whose announcements this service loads

    def on_weights(self, announcement: WeightAnnouncement) -> bool:
        """Load a newer snapshot of one of :attr:`weight_models`; False if it was refused (old weights kept)."""
        return False

    def startup_messages(self) -> list[Message]:
        """Messages for :attr:`output_topic` to produce once, when the service starts (e.g. a resumed state)."""
        return []

    def ready_for(self, message: Message) -> bool:
        """False holds ``message`` back (uncommitted) until, e.g., newer weights arrive."""
        return True

    def waiting_for(self, message: Message) -> str:
        """Why :meth:`ready_for` is False, for logs and stall reports."""
        return ""

    @abstractmethod
    def process(self, message: Message) -> list[Message]:
        """The core call: one input message to zero or more messages for :attr:`output_topic`."""

    def make_durable(self, offsets: dict[str, int], force: bool = False) -> bool:
        """Whether the state covering all input handled so far survives a crash; input is committed only then.

        ``offsets`` are the input positions that would be committed (``"topic/partition"`` → next offset), for a
        checkpoint to record. A service whose state lives in memory (the learner between two checkpoints) returns
        False until its checkpoint is due, or ``force``; its input stays uncommitted meanwhile, so after a crash
        the broker delivers it again to the state restored from the last checkpoint.
        """
        return True

    def close(self) -> None:
        """Release what the service holds outside this process (e.g. an inference engine)."""


class _RecentIds:
    """The last ``size`` batch ids seen, for dropping re-deliveries cheaply."""

    def __init__(self, size: int):
        self.size, self.ids = size, OrderedDict()

    def __contains__(self, batch_id: str) -> bool:
        return batch_id in self.ids

    def add(self, batch_id: str) -> None:
        self.ids[batch_id] = None
        if len(self.ids) > self.size:
            self.ids.popitem(last=False)


class ServiceRunner:
    def __init__(self, service: Service, bus: Bus, replica_id: str, dedupe_window: int = 4096,
                 metrics: ServiceMetrics | None = None):
        self.service, self.replica_id = service, replica_id
        self.metrics = metrics or ServiceMetrics(service.role)
        self.producer = bus.producer(replica_id)
        self.work = bus.consumer(service.input_topic, group=service.role, client_id=replica_id)
        self.weights = (
            bus.consumer("weights", group=None, client_id=replica_id, from_beginning=True) if service.weight_models else None
        )
        self.latest_weights: dict[str, int] = {}
        self.held: dict[tuple[str, int], tuple[Record, Message]] = {}  # per paused partition
        self.uncommitted: dict[int, Record] = {}  # per partition: the newest record handled but not yet committed
        self.recent = _RecentIds(dedupe_window)
        self.counters: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()  # per part of the loop, see time_breakdown()
        self.started = time.perf_counter()
        self._produce(service.startup_messages())

    # ------------------------------------------------------------------ one step

    def poll_once(self, timeout_s: float = 0.0) -> bool:
        """Apply new weights, then handle at most one input record. Returns whether anything was done.

        A record the service is not ready for (a prompt batch waiting for newer weights) is held and its
        partition paused, so records of other partitions keep flowing: Kafka orders records within a partition
        only, and the batch the pipeline needs next may sit behind another partition's held one.
        """
        did = self._apply_weights(timeout_s if self.held else 0.0)
        ready = [held for held in self.held.values() if self.service.ready_for(held[1])]
        if ready:
            record, message = min(ready, key=lambda held: getattr(held[1], "step", 0))
            del self.held[(record.topic, record.partition)]
            self.work.resume(record.partition)
            self._process(record, message)
            return True
        records = self.work.poll(0.0 if self.held else timeout_s, max_records=1)
        if not records:
            return did
        record = records[0]
        with self._timed("decode"):
            message = self._decode(record, self.work)
        if message is None:
            return True
        if not self._same_run(message):
            self._commit(record)
            return True
        if message.batch_id in self.recent:
            self._count("duplicate")
            log.info("%s: batch %s already handled; skipping the re-delivery", self.replica_id, message.batch_id)
            self._commit(record)
            return True
        if not self.service.ready_for(message):
            self.held[(record.topic, record.partition)] = (record, message)
            self.work.pause(record.partition)
            return True
        self._process(record, message)
        return True

    def _process(self, record: Record, message: Message) -> None:
        started = time.perf_counter()
        try:
            with self._timed("compute"):
                outputs = self.service.process(message)
        except InputError as exc:
            self._dead_letter(record, f"cannot process batch {message.batch_id}: {exc}", self.work)
            return
        # Each stage's compute time travels with the batch (lineage is carried forward): the learner's metrics
        # then show where every batch's time went.
        for output in outputs:
            output.lineage[f"seconds.{self.service.role}"] = round(time.perf_counter() - started, 4)
        # Durable state first, then its outputs: a learner's checkpoint precedes the announcement of its weights.
        self._hold_commit(record)
        with self._timed("checkpoint"):
            durable = self._durable()
        with self._timed("produce"):
            self._produce(outputs)
        with self._timed("commit"):
            if durable:
                self._commit_held()
        self.recent.add(message.batch_id)
        seconds = time.perf_counter() - started
        self.counters["produced"] += len(outputs)
        sequences = getattr(message, "response_tokens", getattr(message, "prompt_tokens", None))
        # Response tokens handled: those read downstream, those generated by the generator.
        with_responses = [message] if hasattr(message, "response_lengths") else outputs
        tokens = sum(int(m.response_lengths.sum()) for m in with_responses if hasattr(m, "response_lengths"))
        self._count("processed", len(sequences) if sequences is not None else 0, seconds, tokens)
        self.metrics.lag.labels(self.service.role).set(self.work.lag())

    def _same_run(self, message: Message) -> bool:
        run_id = message.lineage.get(RUN_ID)
        if run_id == self.service.run_id:
            return True
        self._count("other_run")
        log.warning("%s: skipping %s %s of run %r (this is run %r)", self.replica_id, message.SCHEMA,
                    message.batch_id, run_id, self.service.run_id)
        return False

    # status() keys, by outcome; the same outcomes label streamppo_batches_total.
    _COUNTER_KEYS = {"processed": "processed", "duplicate": "duplicates", "dead_letter": "dead_letters",
                     "other_run": "other_runs"}

    def _count(self, outcome: str, sequences: int = 0, seconds: float | None = None, tokens: int = 0) -> None:
        self.counters[self._COUNTER_KEYS[outcome]] += 1
        self.metrics.count(outcome, sequences, seconds, tokens)

    def _produce(self, messages: list[Message]) -> None:
        for message in messages:
            self.producer.send(self.service.output_topic, encode(message), key=message_key(message))
        self.producer.flush()

    @contextmanager
    def _timed(self, part: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - started

    def time_breakdown(self) -> dict[str, float]:
        """Seconds since start spent in each part of the loop; ``wait`` is the rest (polling, held, idle).

        ``compute`` is the service's core (models), ``produce`` encoding and sending, ``decode`` decoding input.
        """
        parts = {k: round(v, 3) for k, v in self.seconds.items()}
        parts["wait"] = round(time.perf_counter() - self.started - sum(self.seconds.values()), 3)
        return parts

    def status(self) -> dict:
        """Counters plus the consumer lag (records in this replica's partitions not yet consumed)."""
        return {**self.counters, "lag": self.work.lag(), "held": len(self.held),
                "busy_s": round(sum(self.seconds.values()), 1)}

    def waiting_for(self) -> str:
        if not self.held:
            return "waiting for input"
        return "; ".join(self.service.waiting_for(message) or "holding a message" for _, message in self.held.values())

    def _commit(self, record: Record) -> None:
        """Commit input, but never past state the service has not made durable (:meth:`Service.make_durable`)."""
        self._hold_commit(record)
        if self._durable():
            self._commit_held()

    def _hold_commit(self, record: Record) -> None:
        # Offsets commit per partition: a later record's commit would also commit an earlier, not yet durable one,
        # so every input record of the partition waits with it.
        self.uncommitted[record.partition] = record

    def _durable(self, force: bool = False) -> bool:
        offsets = {f"{r.topic}/{r.partition}": r.offset + 1 for r in self.uncommitted.values()}
        return not offsets or self.service.make_durable(offsets, force)

    def _commit_held(self) -> None:
        for pending in self.uncommitted.values():
            self.work.commit(pending)
        self.uncommitted.clear()

    def close(self) -> None:
        if self._durable(force=True):
            self._commit_held()
        self.service.close()
        self.producer.close()
        self.work.close()
        if self.weights is not None:
            self.weights.close()

    # ------------------------------------------------------------------ internals

    def _decode(self, record: Record, consumer: Consumer) -> Message | None:
        try:
            return decode(record.value, expected=TOPIC_MESSAGE[record.topic])
        except SchemaError as exc:
            self._dead_letter(record, str(exc), consumer)
            return None

    def _dead_letter(self, record: Record, error: str, consumer: Consumer) -> None:
        letter = DeadLetter(
            error=error, source_topic=record.topic, source_partition=record.partition, source_offset=record.offset,
            payload=record.value, producer=self.replica_id, created_at=time.time(),
        )
        self.producer.send(dlq_topic(record.topic), encode(letter), key=record.key)
        self.producer.flush()
        if consumer is self.work:
            self._commit(record)
        else:
            consumer.commit(record)
        self._count("dead_letter")
        log.warning("%s: %s[%d]@%d sent to %s: %s", self.replica_id, record.topic, record.partition,
                    record.offset, dlq_topic(record.topic), error)

    def _apply_weights(self, timeout_s: float) -> bool:
        if self.weights is None:
            return False
        newest: dict[str, WeightAnnouncement] = {}
        for record in self.weights.poll(timeout_s, max_records=10_000):
            log.debug("%s: weights record at offset %d", self.replica_id, record.offset)
            announcement = self._decode(record, self.weights)
            if announcement is None or not self._same_run(announcement):
                continue
            if announcement.model in self.service.weight_models:
                current = newest.get(announcement.model)
                if current is None or announcement.policy_version > current.policy_version:
                    newest[announcement.model] = announcement
        did = False
        for model, announcement in newest.items():
            if announcement.policy_version > self.latest_weights.get(model, -1):
                self.latest_weights[model] = announcement.policy_version
                with self._timed("load_weights"):
                    loaded = self.service.on_weights(announcement)
                if loaded:
                    self.metrics.policy_version.labels(self.service.role).set(announcement.policy_version)
                did = True
        return did
