"""What every service shares: consume → decode → core → encode → produce → commit, with a dead-letter topic.

A :class:`~services.service.Service` is the thin adapter around a core in ``common/``; a :class:`ServiceRunner`
moves records for it and drives its lifecycle (see the :class:`~services.service.Service` docstring). The runner is
the only place that touches the bus, and the only place that decides delivery (``docs/ARCHITECTURE.md``, "Delivery
rules"):

- a record that fails to decode or validate goes to ``<topic>.dlq`` with the error and its source offset, and is
  committed past: bad input never stops a service and is never silently dropped;
- outputs are produced and flushed *before* the input is committed (at-least-once);
- a record whose idempotency keys (its batch id, or past the generator its groups' keys) this replica handled
  already is committed past without being processed again, one with some of them is processed without them (one
  memory, which a service that checkpoints keeps with its state: :class:`~services.service.Progress`);
- weight announcements are read by every replica (no group): :class:`~services.runtime.weights_feed.WeightsFeed`;
- batches too large for a record travel by reference: :class:`~services.runtime.referenced_batches.ReferencedBatches`;
- a streaming service (``Service.streams``) has several inputs in flight: each is committed once its last outputs are
  out, never past the oldest one in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import blake3

from common.batch_store import BatchStore, BatchStoreError
from common.schema import (
    RUN_ID,
    TOPIC_MESSAGE,
    BatchMessage,
    BatchReference,
    DeadLetter,
    Message,
    ReplicaStatus,
    SchemaError,
    decode,
    encode,
    message_key,
    message_partition,
)
from common.signing import Signer
from services.roles import COMPACTED_TOPICS, LOG_TOPIC, STATUS_TOPIC, WEIGHTS_TOPIC
from services.runtime.channel import BusChannel
from services.runtime.dedupe import RecentIds
from services.runtime.metrics import ServiceMetrics
from services.runtime.referenced_batches import ReferencedBatches
from services.runtime.weights_feed import WeightsFeed
from services.service import Collected, Dropped, InputError, Progress, Service
from services.transport import Bus, LogReplaced, Record, dlq_topic

log = logging.getLogger(__name__)

__all__ = ["LOG_CHECK_S", "ServiceRunner", "consumer_group"]

LOG_CHECK_S = 2.0  # how often a replica checks that its log is still the one it started on
STREAM_POLL_S = 0.01  # how long a streaming service's runner waits, with work in hand, before collecting again
ADMIT_PER_POLL = 64  # the most inputs a streaming service is given in one poll
WEIGHTS_CATCH_UP_S = 1.0  # how long one poll reads the weights topic towards its end before a replica's first input
# A dead letter's fields but its payload (error, topic, key, record overhead): what the largest record leaves room for.
DEAD_LETTER_FIELDS_BYTES = 64 * 1024
DEAD_LETTER_KEY_BYTES = 1024  # a source key past this is cut: keys name a batch, a replica or a model


class OutputError(Exception):
    """A service's output that cannot be encoded (a value the schema refuses): nothing of the outputs is sent, and
    the input they came from is dead-lettered with why. Sent anyway, it would fail the same way at every restart."""


def consumer_group(role: str, log: str) -> str:
    """The consumer group of a role's replicas on one log: replicas share its partitions."""
    return f"{role}.{log[:12]}"


@dataclass(frozen=True)
class _Held:
    """An input record the service is not ready for, kept aside (uncommitted) since ``since``."""

    record: Record
    message: BatchMessage
    since: float  # time.monotonic()


class ServiceRunner:
    """Moves records for one service, on one log: built and started by a :class:`~services.runtime.replica.Replica`,
    which holds the service's life (``start()`` produces the service's :meth:`~Service.start` messages before the
    first input is read)."""

    def __init__(self, service: Service, bus: Bus, metrics: ServiceMetrics | None = None):
        if not getattr(service, "run_id", None):
            raise TypeError(f"{type(service).__name__} was not initialised by Service.__init__ (it has no run id)")
        self.service, self.replica_id = service, service.replica_id
        self.metrics = metrics or ServiceMetrics(service.role)
        self.counters: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()  # per part of the loop, see time_breakdown()
        self.started = time.perf_counter()
        key = service.config.signing_key()  # before anything joins the bus: a missing key is a config error
        self.signer = Signer(key) if key is not None else None
        # The log this replica works on, made its own if the topics have no identity yet. Its consumer group is
        # the role's on this log: offsets committed on another log (a broker that lost its data, then old replicas
        # that rejoined on the new one) are never read, and members of such a group never hold this one back.
        self.bus, self.log = bus, bus.log_identity(LOG_TOPIC, create=True)
        self.log_checked = time.monotonic()
        self.producer = bus.producer(self.replica_id)
        self.work = (
            bus.consumer(service.input_topic, group=consumer_group(service.role, self.log), client_id=self.replica_id)
            if service.input_topic is not None
            else None
        )
        self.weights = (
            WeightsFeed(
                service,
                bus.consumer(WEIGHTS_TOPIC, group=None, client_id=self.replica_id),
                self.accept,
                self.metrics,
                self.counters,
                self._timed,
            )
            if service.weight_models
            else None
        )
        self.held: list[_Held] = []  # kept aside, see poll_once
        self.in_flight: dict[str, _Held] = {}  # a streaming service's inputs not done, by batch id (see _admit)
        self.uncollected: list[Collected] = []  # a streaming service's outputs not yet sent (see _collect)
        self.stream_tokens: Counter[str] = Counter()  # response tokens sent so far per input in flight
        self.last_progress = time.monotonic()  # when input was last handled (see _release_stuck)
        self.log_ends: dict[int, int] = {}  # per input partition: the highest end offset seen
        self.uncommitted: dict[int, Record] = {}  # per partition: the newest record handled but not yet committed
        config = service.config
        retention = config.kafka.retention
        self.referenced = ReferencedBatches(
            BatchStore(config.batch_store, retention=config.batch_retention),
            config.pipeline.inline_max_bytes,
            remove_committed=retention.remove_committed_batches,
        )
        # The batch ids this replica handled; a service that restores state (the learner) gives back the ids its
        # state covers, so a batch applied before a crash, but not committed, is recognised when it comes again.
        restored = service.restored()
        self.recent = RecentIds(config.pipeline.dedupe_window, restored.handled if restored else ())
        self.processing = False  # True while an input is processed: a stop request waits for it (see _process)
        # Outputs whose sending failed, and the input they came from (None: a tick's), see _process.
        self.unsent: tuple[Record | None, list[Message], bool] | None = None
        self.settled: bool | None = None  # see settle()
        self.channels: dict[str, BusChannel] = {}

    def start(self) -> None:
        """Connect the service's channels, then produce what its ``start()`` returns, before any input is read."""
        self.channels = {
            name: BusChannel(self.bus, self.replica_id, requests, replies, self.produce, self.accept, self.dead_letter)
            for name, (requests, replies) in self.service.channels().items()
        }
        if self.channels:
            self.service.connect(dict(self.channels))
        self.produce(self.service.start())

    # ------------------------------------------------------------------ one step

    def poll_once(self, timeout_s: float = 0.0) -> bool:
        """Apply new weights, then handle at most one input record. Returns whether anything was done.

        A record the service is not ready for (a prompt batch waiting for newer weights, experience of a later
        step) is kept aside, uncommitted, and reading goes on past it: the batch the pipeline needs next may sit
        behind it, in its partition or another's (Kafka orders records within a partition only). Input is committed
        only below the oldest record kept aside in its partition; with ``pipeline.held_per_partition`` kept aside,
        a partition is paused until one is processed. The ready record of the earliest step goes first.
        """
        self._check_log()
        if self.unsent is not None:
            self._send_unsent()
            return True
        if self.weights is not None and not self.weights.catch_up(WEIGHTS_CATCH_UP_S):
            return True  # nothing is taken before the newest weights are known (WeightsFeed.catch_up)
        # The weights topic is waited on only when nothing else can move: input held for newer weights and no work in
        # hand (a streaming engine with groups in flight runs on meanwhile: waiting here starved it between steps).
        idle = self.work is None or (bool(self.held) and not self.service.under_way())
        did = self.weights is not None and self.weights.apply(timeout_s if idle else 0.0)
        if self.work is None:
            return self._tick() or did  # what it takes up may follow from the weights just offered (a feeder's)
        if not self.service.streams:
            return self._take_input(timeout_s, self._process) or did or self._tick()
        did = self._collect() or self.service.under_way() or did
        # While work is in hand, come back soon for its outputs rather than waiting on input.
        wait = 0.0 if did else min(timeout_s, STREAM_POLL_S) if self.in_flight else timeout_s
        if self.service.room() > 0:
            # As many inputs as it has room for (a generator answering a gateway takes each call as it comes), the
            # first waited for, the others only if they are there.
            taken = 0
            while (
                taken < ADMIT_PER_POLL
                and self.service.room() > 0
                and self._take_input(wait if not taken else 0.0, self._admit)
            ):
                taken += 1
            return bool(taken) or did
        if not did:
            time.sleep(wait)
        return did

    def _take_input(self, timeout_s: float, handle) -> bool:
        """Hand one input record to ``handle(record, message)``: the ready held record of the earliest step, else
        the next record read (kept aside if the service is not ready for it). Returns whether anything was done."""
        ready = [held for held in self.held if self.service.ready_for(held.message)]
        if ready:
            held = min(ready, key=lambda held: held.message.step)
            self.held.remove(held)
            self.work.resume(held.record.partition)
            handle(held.record, held.message)
            return True
        if self._release_stuck():
            return True
        records = self.work.poll(0.0 if self.held else timeout_s, max_records=1)
        self._check_log_continuity()
        if not records:
            return False
        record = records[0]
        with self._timed("decode"):
            message = self.accept(record, TOPIC_MESSAGE[record.topic])
        if message is None:
            self._commit(record)
            return True
        message = self._unhandled_part(message)
        if message is None:
            self._count("duplicate")
            self._commit(record)
            return True
        if not self.service.ready_for(message):
            self.held.append(_Held(record, message, time.monotonic()))
            if len(self._held_in(record.partition)) >= self.service.config.pipeline.held_per_partition:
                self.work.pause(record.partition)
            return True
        handle(record, message)
        return True

    # ------------------------------------------------------------------ a streaming service

    def _admit(self, record: Record, message: BatchMessage) -> None:
        """Give a streaming service one more input; it stays uncommitted until its last outputs are out."""
        self.last_progress = time.monotonic()
        if message.batch_id in self.in_flight:  # delivered again while its first delivery is in hand
            self._count("duplicate")
            self._commit(record)  # never past the first delivery, which is in flight
            return
        try:
            with self._timed("compute"), self._uninterrupted():
                self.service.admit(message)
        except InputError as exc:
            self._dead_letter(record, f"cannot process batch {message.batch_id}: {exc}")
            self._commit(record)
            return
        self.in_flight[message.batch_id] = _Held(record, message, time.monotonic())

    def _collect(self) -> bool:
        """Send what the streaming service has ready (first what failed to go out before); an input whose last
        outputs are out is committed. Returns whether anything was sent."""
        if not self.uncollected:
            started = time.perf_counter()
            with self._timed("compute"), self._uninterrupted():
                self.uncollected = list(self.service.collect())
            outputs = [output for item in self.uncollected for output in item.outputs]
            for output in outputs:  # this stage's compute, as _process records it: the call's, shared out
                output.lineage[f"seconds.{self.service.role}"] = round(
                    (time.perf_counter() - started) / len(outputs), 4
                )
        did = bool(self.uncollected)
        while self.uncollected:
            item = self.uncollected[0]
            try:
                with self._timed("produce"):
                    self.produce(item.outputs)  # raises while the broker is away: sent again at the next poll
            except OutputError as exc:
                self._dead_letter(self.in_flight[item.batch_id].record, f"batch {item.batch_id}: {exc}")
                item = dataclasses.replace(item, outputs=[])
            self.uncollected.pop(0)
            self.last_progress = time.monotonic()
            self.counters["produced"] += len(item.outputs)
            self.stream_tokens[item.batch_id] += sum(o.response_tokens_total for o in item.outputs)
            if item.done:
                self._finish(item.batch_id)
        return did

    def _finish(self, batch_id: str) -> None:
        held = self.in_flight.pop(batch_id)
        for key in held.message.idempotency_keys():
            self.recent.add(key)
        tokens = self.stream_tokens.pop(batch_id, 0)
        self._count("processed", held.message.rows, time.monotonic() - held.since, tokens)
        self._commit(held.record)
        self.metrics.lag.labels(self.service.role).set(self.work.lag())

    def _unhandled_part(self, message: BatchMessage) -> BatchMessage | None:
        """``message`` less what this replica handled already (by idempotency key: the batch id, or past the
        generator each group's), or None when that is all of it: a re-delivery, or groups sampled again after a
        generator died with part of its prompt batch sent."""
        keys = message.idempotency_keys()
        handled = {key for key in keys if key in self.recent}
        if not handled:
            return message
        if len(handled) == len(keys):
            log.info("%s: batch %s already handled; skipping the re-delivery", self.replica_id, message.batch_id)
            return None
        log.info(
            "%s: batch %s: %d of its %d groups already handled; handling the rest",
            self.replica_id,
            message.batch_id,
            len(handled),
            len(keys),
        )
        return message.without_groups(handled)

    @contextmanager
    def _uninterrupted(self):
        """A stop request waits for the block: the compute of the batch in hand and its durable state. (The rest,
        producing and committing, may be cut short: the input then comes again, see _process.)"""
        self.processing = True
        try:
            yield
        finally:
            self.processing = False

    def _process(self, record: Record, message: BatchMessage) -> None:
        self.last_progress = time.monotonic()
        started = time.perf_counter()
        outcome = "processed"
        try:
            with self._timed("compute"), self._uninterrupted():
                outputs = self.service.process(message)
        except InputError as exc:
            self._dead_letter(record, f"cannot process batch {message.batch_id}: {exc}")
            self._commit(record)
            return
        except Dropped as exc:
            outcome, outputs = "dropped", []
            log.warning("%s: dropped batch %s: %s", self.replica_id, message.batch_id, exc)
        # Each stage's compute time travels with the batch (lineage is carried forward): the learner's metrics
        # then show where every batch's time went.
        for output in outputs:
            output.lineage[f"seconds.{self.service.role}"] = round(time.perf_counter() - started, 4)
        if outcome == "processed":  # a dropped record must not make the real batch of its id look re-delivered
            for key in message.idempotency_keys():
                self.recent.add(key)
        self._defer_commit(record)

        def set_aside(exc: OutputError) -> None:  # nothing was sent: the input is dead-lettered with why, and committed
            nonlocal outcome, outputs
            self._dead_letter(record, f"cannot process batch {message.batch_id}: {exc}")
            outcome, outputs = "dead_letter", []

        self._save_send_commit(record, outputs, unencodable=set_aside)
        seconds = time.perf_counter() - started
        # Response tokens handled: those read downstream, those generated by the generator.
        made = (output.response_tokens_total for output in outputs if isinstance(output, BatchMessage))
        tokens = message.response_tokens_total or sum(made)
        if outcome != "dead_letter":  # counted as it was set aside
            self._count(outcome, message.rows, seconds, tokens)
        self.metrics.lag.labels(self.service.role).set(self.work.lag())

    def _tick(self) -> bool:
        """What the service takes up on time alone (:meth:`Service.tick`): its state made durable, then its outputs
        sent, as for an input. Returns whether there were any."""
        with self._timed("compute"), self._uninterrupted():
            outputs = self.service.tick()
        if not outputs:
            return False
        self._save_send_commit(None, outputs)
        return True

    def _save_send_commit(
        self,
        record: Record | None,
        outputs: list[Message],
        durable: bool | None = None,
        unencodable: Callable[[OutputError], None] | None = None,
    ) -> None:
        """The one order of handing on what a service made: its state made durable first (a learner's checkpoint
        precedes the announcement of its weights), then its outputs sent, then its input (``record``; None: a
        tick's) committed, as far as the durable state covers. Outputs that did not all go out (a broker error, a
        stop) are kept (``unsent``) and sent again before anything else, their input committed only then: processing
        it again instead would apply a learner's update twice, its checkpoint may hold it already. ``durable``:
        the state was made durable before (outputs sent again). Outputs that cannot be encoded go nowhere:
        ``unencodable(error)`` sets their input aside, and it is committed as if they had gone."""
        if durable is None:
            with self._timed("checkpoint"), self._uninterrupted():
                durable = self._durable()
        try:
            with self._timed("produce"):
                self.produce(outputs)
            self.counters["produced"] += len(outputs)
        except OutputError as exc:
            if unencodable is None:
                raise
            unencodable(exc)  # nothing was sent
        except BaseException:
            self.unsent = (record, outputs, durable)
            raise
        if durable:
            with self._timed("commit"):
                self._commit_deferred()

    def _send_unsent(self) -> None:
        """Send the outputs whose sending failed (raises again while the broker is away), then commit their input."""
        record, outputs, durable = self.unsent
        self.unsent = None
        self._save_send_commit(record, outputs, durable)
        of = f"{record.topic}[{record.partition}]@{record.offset}" if record is not None else "a tick"
        log.info("%s: outputs of %s sent again", self.replica_id, of)

    def _release_stuck(self) -> bool:
        """Dead-letter the held record furthest ahead once nothing could be processed for ``hold_timeout_s``.

        Every held record waiting that long, and no input handled meanwhile, means the partitions are blocked: a
        record that waits for something that never comes (a forged far-future step) keeps the records behind it
        in its partition, which may be the ones the pipeline needs, from ever being read.
        """
        limit = self.service.config.pipeline.hold_timeout_s
        now = time.monotonic()
        if not self.held or now - self.last_progress < limit:
            return False
        stuck = max(self.held, key=lambda held: (held.message.step, -held.since))
        if now - stuck.since < limit:
            return False
        self.held.remove(stuck)
        self.work.resume(stuck.record.partition)
        why = self.service.waiting_for(stuck.message) or "held"
        self._dead_letter(stuck.record, f"held {now - stuck.since:.0f} s ({why}) while no input could be processed")
        self._commit(stuck.record)
        self.last_progress = now
        return True

    def _check_log(self) -> None:
        """Every few seconds: is the log still the one this replica started on? Raises :class:`LogReplaced` when the
        broker lost it (the identity is gone) or its topics were made again (another identity)."""
        if time.monotonic() - self.log_checked < LOG_CHECK_S:
            return
        self.log_checked = time.monotonic()
        now = self.bus.log_identity(LOG_TOPIC)
        if now != self.log:
            raise LogReplaced(
                f"{self.replica_id}: the log it worked on ({self.log}) is gone (the log's identity is now "
                f"{now or 'missing'}): the broker lost its data or its topics were made again"
            )

    def _check_log_continuity(self) -> None:
        """Raises :class:`LogReplaced` when input partitions' logs end below where they had reached: the broker lost
        them."""
        shrunk = []
        for partition, end in sorted(self.work.log_ends().items()):
            reached = self.log_ends.get(partition, 0)
            if end < reached:
                shrunk.append(f"{self.service.input_topic}[{partition}] {reached} -> {end}")
            self.log_ends[partition] = end
        if shrunk:
            raise LogReplaced(
                f"{self.replica_id}: the broker lost its data (a new, empty broker?): log ends went back "
                f"({', '.join(shrunk)})"
            )

    # status() keys, by outcome; the same outcomes label streamppo_batches_total.
    _COUNTER_KEYS = {
        "processed": "processed",
        "dropped": "dropped",
        "duplicate": "duplicates",
        "dead_letter": "dead_letters",
        "other_run": "other_runs",
    }

    def _count(self, outcome: str, sequences: int = 0, seconds: float | None = None, tokens: int = 0) -> None:
        self.counters[self._COUNTER_KEYS[outcome]] += 1
        if tokens:
            self.counters["tokens"] += tokens
        self.metrics.count(outcome, sequences, seconds, tokens)

    def produce(self, messages: list[Message], topic: str | None = None) -> None:
        """Sign and encode every message, then send them all: one that cannot be encoded raises
        :class:`OutputError` before anything is sent."""
        topic = topic or self.service.output_topic
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
        lag = self.work.lag() if self.work is not None else 0
        busy = round(sum(self.seconds.values()), 1)
        counted = {**self.counters, **self.service.counters()}
        return {**counted, "lag": lag, "held": len(self.held), "in_flight": len(self.in_flight), "busy_s": busy}

    def waiting_for(self) -> str:
        if self.weights is not None and not self.weights.caught_up:
            return f"reading {WEIGHTS_TOPIC} to its end: the newest weights are loaded before any input is taken"
        if not self.held:
            in_hand = self.service.in_hand() if self.in_flight else ""
            return f"{len(self.in_flight)} input(s) in hand: {in_hand}" if in_hand else "waiting for input"
        # The next one in full; those behind it, which wait for the same and more, counted: one line stays short
        # however many are held.
        now = time.monotonic()
        held = sorted(self.held, key=lambda held: (held.message.step, held.record.partition, held.record.offset))
        first = held[0]
        said = (
            f"{self.service.input_topic}[{first.record.partition}] for {now - first.since:.0f} s: "
            f"{self.service.waiting_for(first.message) or 'holding a message'}"
        )
        if len(held) > 1:
            steps = sorted({h.message.step for h in held[1:]})
            said += f" ({len(held) - 1} more held behind it, of steps {steps[0]}..{steps[-1]})"
        return said

    def held_seconds(self) -> float:
        """How long the oldest held record has waited (0 if none)."""
        return max((time.monotonic() - held.since for held in self.held), default=0.0)

    def publish_status(self, state: str | None = None, counters: dict | None = None) -> ReplicaStatus:
        """Say what this replica is doing on the status topic (and in the held-input gauges); returns the report.

        ``state`` defaults to ``waiting`` while input is held, else ``serving``; ``counters``: more to report (a
        fleet's share of the replica for this run).
        """
        held_seconds = self.held_seconds()
        in_hand = self.service.in_hand() if self.in_flight else ""
        counted = self.service.counters()
        for name, value in counted.items():
            self.metrics.counted.labels(self.service.role, name).set(value)
        self.metrics.held_records.labels(self.service.role).set(len(self.held))
        self.metrics.held_seconds.labels(self.service.role).set(held_seconds)
        loaded = self.weights.loaded if self.weights is not None else {}
        versions = {f"weights.{model}": version for model, version in loaded.items()}
        signed = int(self.signer is not None)  # streamppo status says when a run is unsigned
        status = ReplicaStatus(
            replica=self.replica_id,
            role=self.service.role,
            run_id=self.service.run_id,
            state=state or ("waiting" if self.held or in_hand else "serving"),
            waiting_for=self.waiting_for() if self.held or in_hand else "",
            held=len(self.held),
            held_seconds=round(held_seconds, 1),
            lag=self.work.lag() if self.work is not None else 0,
            counters={**self.counters, **counted, **versions, "signed": signed, **(counters or {})},
            created_at=time.time(),
            url=self.service.url,
        )
        self.producer.send(STATUS_TOPIC, encode(status), key=self.replica_id.encode())
        self.producer.flush()
        return status

    def _commit(self, record: Record) -> None:
        """Commit input, but never past state the service has not made durable (:meth:`Service.make_durable`)."""
        self._defer_commit(record)
        if self._durable():
            self._commit_deferred()

    def _defer_commit(self, record: Record) -> None:
        # Offsets commit per partition: a later record's commit would also commit an earlier, not yet durable one,
        # so every input record of the partition waits with it.
        pending = self.uncommitted.get(record.partition)
        if pending is None or record.offset > pending.offset:
            self.uncommitted[record.partition] = record

    def _held_in(self, partition: int) -> list[_Held]:
        return [held for held in self.held if held.record.partition == partition]

    def _done_below(self, pending: Record) -> int:
        """The offset below which the partition of ``pending`` (handled) is done: past ``pending``, unless a
        record before it is kept aside or (a streaming service's) in flight."""
        aside = [*self.held, *self.in_flight.values()]
        return min([pending.offset + 1, *(h.record.offset for h in aside if h.record.partition == pending.partition)])

    def _durable(self, force: bool = False) -> bool:
        offsets = {f"{r.topic}/{r.partition}": self._done_below(r) for r in self.uncommitted.values()}
        return not offsets or self.service.make_durable(Progress(offsets, self.recent.to_list(), self.log), force)

    def _commit_deferred(self) -> None:
        for partition, pending in list(self.uncommitted.items()):
            below = self._done_below(pending)
            if below > 0:
                # Committing a record commits its partition up to it: the last one done, not past what is aside.
                done = pending if below == pending.offset + 1 else dataclasses.replace(pending, offset=below - 1)
                self.work.commit(done)
                self.referenced.release(done)
            if below == pending.offset + 1:
                del self.uncommitted[partition]

    def release_lost_log(self, close_within_s: float = 1.0) -> None:
        """After :class:`LogReplaced`: the service's state made durable (a learner checkpoints what it applied, as on
        a stop: the run goes on from it on the new log), and the clients released without sending or committing
        anything, since whatever they would write now could land on the log that took the lost one's place. The
        service is not closed: its models serve a runner on the new log (:meth:`Service.take_up_new_log`)."""
        self._make_durable_once()
        clients = [self.work, self.weights, *self.channels.values()]
        closes = [self.producer.discard, *(client.close for client in clients if client is not None), self.bus.close]

        def release() -> None:
            for close in closes:
                try:
                    close()
                except Exception as exc:  # a client of a lost broker may fail to close; nothing of it is needed
                    log.debug("%s: closing a client of the lost log: %s", self.replica_id, exc)

        # Clients of a lost broker may block as they close (leaving a group, say): they are left to it.
        releasing = threading.Thread(target=release, name=f"{self.replica_id}-leave", daemon=True)
        releasing.start()
        releasing.join(timeout=close_within_s)

    def leave_for_new_log(self, exc: LogReplaced, go_on: bool = True) -> bool:
        """The lost log released (the service's state made durable, the clients let go), then whether the service
        goes on on the new log in this process (:meth:`Service.take_up_new_log`; never when not ``go_on``: a stop was
        asked for). Says which, in one line."""
        self.release_lost_log()
        if go_on and self.service.take_up_new_log():
            log.warning("%s; going on on the new log (models kept, the work in flight on the old one dropped)", exc)
            return True
        log.error("%s; %s stops here, to be started again on the new log", exc, self.replica_id)
        return False

    def close(self) -> None:
        """:meth:`settle`, then :meth:`disconnect`."""
        self.settle()
        self.disconnect()

    def settle(self) -> None:
        """The part of closing that needs no broker: the service's state made durable (a learner's checkpoint),
        its engines and files released."""
        if self.settled is None:
            self._make_durable_once()
            self.service.close()

    def _make_durable_once(self) -> None:
        """The service's state made durable, once, whatever comes after (a stop, a lost log): an input whose outputs
        are not all out is not committed, so it comes again."""
        if self.settled is None:
            if self.unsent is not None and self.unsent[0] is not None:
                self.uncommitted.pop(self.unsent[0].partition, None)
            self.settled = self._durable(force=True)

    def disconnect(self) -> None:
        """The broker's part of closing, after :meth:`settle`: commit what the durable state covers, close the
        clients (a group member leaves its group)."""
        if self.settled:
            self._commit_deferred()
        self.producer.close()
        if self.work is not None:
            self.work.close()
        if self.weights is not None:
            self.weights.close()
        for channel in self.channels.values():
            channel.close()

    # ------------------------------------------------------------------ internals

    def accept(self, record: Record, expected: type) -> Message | None:
        """``record`` decoded as ``expected`` (a batch sent by reference, fetched), if it is valid and of this run.

        What does not decode or validate is dead-lettered, another run's message skipped and counted, a tombstone
        (a null value on a compacted topic: the deletion of its key's record, which a reader that has taken the
        record in has nothing to undo of) counted: None for each, and the caller commits past the record (a group's
        input) or not (the weights feed's).
        """
        if record.value is None and record.topic not in COMPACTED_TOPICS:
            self._dead_letter(
                record, f"a record with a null value (a tombstone) on {record.topic}, which is not compacted"
            )
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
            self._dead_letter(record, str(exc))
            return None
        if self.signer is not None and not self.signer.verify(message):
            self.counters["unsigned"] += 1
            self._dead_letter(record, f"{message.SCHEMA} {message.batch_id} is unsigned or signed with another key")
            return None
        if message.lineage.get(RUN_ID) != self.service.run_id:
            self._count("other_run")
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

    def _fit_dead_letter(self, payload: bytes | None, key: bytes | None, error: str) -> tuple[bytes, bytes | None, str]:
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

    def _dead_letter(self, record: Record, error: str) -> None:
        """Set an input record aside (see :meth:`dead_letter`); a batch it references keeps its file."""
        self.dead_letter(record.topic, record.value, record.key, error, record.partition, record.offset)
        self.referenced.keep(record)

    def dead_letter(
        self, topic: str, payload: bytes | None, key: bytes | None, error: str, partition: int = -1, offset: int = -1
    ) -> None:
        """The one place a record is set aside: ``payload`` of ``topic`` (at ``partition``/``offset``, or -1 for a
        message that never was a record, such as a channel's) on ``<topic>.dlq`` with why, counted and said."""
        payload, key, error = self._fit_dead_letter(payload, key, error)
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
        self._count("dead_letter")
        where = f"{topic}[{partition}]@{offset}" if partition >= 0 else f"a record of {topic}"
        log.warning("%s: %s sent to %s: %s", self.replica_id, where, dlq_topic(topic), error)
