"""What every service shares: consume → decode → core → encode → produce → commit, with a dead-letter topic.

A :class:`~services.service.Service` is the thin adapter around a core in ``common/``; a :class:`ServiceRunner`
moves records for it and a :class:`~services.runtime.replica.Replica` drives its life (started, stepped, stopped).
The runner is the only place that touches the bus, and the only place that decides delivery
(``docs/ARCHITECTURE.md``, "Delivery rules"), each rule in a part of its own:

- a record that fails to decode or validate goes to ``<topic>.dlq`` with the error and its source offset, and is
  committed past: bad input never stops a service and is never silently dropped (:mod:`.intake`);
- outputs are produced and flushed *before* the input is committed (at-least-once; :mod:`.sending`), and input is
  committed only as far as the service's durable state covers it (:mod:`.offsets`);
- a record the service is not ready for is kept aside, uncommitted, and reading goes on past it (:mod:`.held`);
- a record whose idempotency keys (its batch id, or past the generator its groups' keys) this replica handled
  already is committed past without being processed again, one with some of them is processed without them (one
  memory, which a service that checkpoints keeps with its state: :class:`~services.service.Progress`);
- weight announcements are read by every replica (no group): :class:`~services.runtime.weights_feed.WeightsFeed`;
- batches too large for a record travel by reference: :class:`~services.runtime.referenced_batches.ReferencedBatches`;
- a streaming service (``Service.streams``) has several inputs in flight: each is committed once its last outputs are
  out, never past the oldest one in flight (:mod:`.streaming`);
- a log the broker lost is left (:mod:`.log_watch`); what the replica does is said (:mod:`.status`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager

from common.batch_store import BatchStore
from common.schema import TOPIC_MESSAGE, BatchMessage, Message, ReplicaStatus, encode
from common.signing import Signer
from services.roles import LOG_TOPIC, STATUS_TOPIC, WEIGHTS_TOPIC
from services.runtime import status as reports
from services.runtime.channel import BusChannel
from services.runtime.dedupe import RecentIds
from services.runtime.held import HeldInputs
from services.runtime.intake import Intake
from services.runtime.log_watch import LogWatch
from services.runtime.metrics import ServiceMetrics
from services.runtime.offsets import Offsets
from services.runtime.referenced_batches import ReferencedBatches
from services.runtime.sending import OutputError, Sender
from services.runtime.streaming import Streaming
from services.runtime.weights_feed import WeightsFeed
from services.service import Dropped, InputError, Service
from services.transport import Bus, LogReplaced, Record

log = logging.getLogger(__name__)

__all__ = ["OutputError", "ServiceRunner", "consumer_group"]

STREAM_POLL_S = 0.01  # how long a streaming service's runner waits, with work in hand, before collecting again
ADMIT_PER_POLL = 64  # the most inputs a streaming service is given in one poll
WEIGHTS_CATCH_UP_S = 1.0  # how long one poll reads the weights topic towards its end before a replica's first input


def consumer_group(role: str, log: str) -> str:
    """The consumer group of a role's replicas on one log: replicas share its partitions."""
    return f"{role}.{log[:12]}"


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
        config = service.config
        key = config.signing_key()  # before anything joins the bus: a missing key is a config error
        self.signer = Signer(key) if key is not None else None
        # The log this replica works on, made its own if the topics have no identity yet. Its consumer group is
        # the role's on this log: offsets committed on another log (a broker that lost its data, then old replicas
        # that rejoined on the new one) are never read, and members of such a group never hold this one back.
        self.bus, self.log = bus, bus.log_identity(LOG_TOPIC, create=True)
        self.log_watch = LogWatch(bus, self.replica_id, self.log)
        self.producer = bus.producer(self.replica_id)
        self.referenced = ReferencedBatches(
            BatchStore(config.batch_store, retention=config.batch_retention),
            config.pipeline.inline_max_bytes,
            remove_committed=config.kafka.retention.remove_committed_batches,
        )
        self.sender = Sender(self.producer, self.referenced, self.signer, self.counters, service.output_topic)
        self.intake = Intake(service, self.producer, self.referenced, self.signer, self.counters, self.count)
        self.work = (
            bus.consumer(
                service.input_topic,
                group=consumer_group(service.role, self.log),
                client_id=self.replica_id,
                member=self.replica_id,  # a restart under the same id is the same member; see Bus.remove_member
            )
            if service.input_topic is not None
            else None
        )
        self.weights = (
            WeightsFeed(
                service,
                bus.consumer(WEIGHTS_TOPIC, group=None, client_id=self.replica_id),
                self.intake.accept,
                self.metrics,
                self.counters,
                self.timed,
            )
            if service.weight_models
            else None
        )
        self.held = HeldInputs(service, self.work)
        self.streaming = Streaming(self)
        self.last_progress = time.monotonic()  # when input was last handled (see HeldInputs.take_stuck)
        # The batch ids this replica handled; a service that restores state (the learner) gives back the ids its
        # state covers, so a batch applied before a crash, but not committed, is recognised when it comes again.
        restored = service.restored()
        self.recent = RecentIds(config.pipeline.dedupe_window, restored.handled if restored else ())
        self.offsets = Offsets(service, self.work, self.referenced, self.recent, self.log, self._aside)
        self.processing = False  # True while an input is processed: a stop request waits for it (see _process)
        # Outputs whose sending failed, and the input they came from (None: a tick's), see _save_send_commit.
        self.unsent: tuple[Record | None, list[Message], bool] | None = None
        self.settled: bool | None = None  # see settle()
        self.channels: dict[str, BusChannel] = {}

    def _aside(self) -> list[Record]:
        """The input records kept aside, uncommitted: held, or a streaming service's in flight."""
        return [held.record for held in (*self.held, *self.streaming.in_flight.values())]

    def start(self) -> None:
        """Connect the service's channels, then produce what its ``start()`` returns, before any input is read."""
        self.channels = {
            name: BusChannel(
                self.bus,
                self.replica_id,
                requests,
                replies,
                self.sender.send,
                self.intake.accept,
                self.intake.dead_letter,
            )
            for name, (requests, replies) in self.service.channels().items()
        }
        if self.channels:
            self.service.connect(dict(self.channels))
        self.sender.send(self.service.start())

    # ------------------------------------------------------------------ one step

    def poll_once(self, timeout_s: float = 0.0) -> bool:
        """Apply new weights, then handle at most one input record. Returns whether anything was done.

        A record the service is not ready for is kept aside (:mod:`.held`); input is committed only below the
        oldest record kept aside in its partition. The ready record of the earliest step goes first.
        """
        self.log_watch.check_identity()
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
        did = self.streaming.collect() or self.service.under_way() or did
        # While work is in hand, come back soon for its outputs rather than waiting on input.
        wait = 0.0 if did else min(timeout_s, STREAM_POLL_S) if self.streaming.in_flight else timeout_s
        if self.service.room() > 0:
            # As many inputs as it has room for (a generator answering a gateway takes each call as it comes), the
            # first waited for, the others only if they are there.
            taken = 0
            while (
                taken < ADMIT_PER_POLL
                and self.service.room() > 0
                and self._take_input(wait if not taken else 0.0, self.streaming.admit)
            ):
                taken += 1
            return bool(taken) or did
        if not did:
            time.sleep(wait)
        return did

    def _take_input(self, timeout_s: float, handle: Callable[[Record, BatchMessage], None]) -> bool:
        """Hand one input record to ``handle(record, message)``: the ready held record of the earliest step, else
        the next record read (kept aside if the service is not ready for it). Returns whether anything was done."""
        held = self.held.take_ready()
        if held is not None:
            handle(held.record, held.message)
            return True
        if self._release_stuck():
            return True
        records = self.work.poll(0.0 if self.held else timeout_s, max_records=1)
        self.log_watch.check_ends(self.work, self.service.input_topic)
        if not records:
            return False
        record = records[0]
        with self.timed("decode"):
            message = self.intake.accept(record, TOPIC_MESSAGE[record.topic])
        if message is None:
            self.offsets.commit(record)
            return True
        message = self._unhandled_part(message)
        if message is None:
            self.count("duplicate")
            self.offsets.commit(record)
            return True
        if not self.service.ready_for(message):
            self.held.keep(record, message)
            return True
        handle(record, message)
        return True

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
    def uninterrupted(self):
        """A stop request waits for the block: the compute of the batch in hand and its durable state. (The rest,
        producing and committing, may be cut short: the input then comes again, see _save_send_commit.)"""
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
            with self.timed("compute"), self.uninterrupted():
                outputs = self.service.process(message)
        except InputError as exc:
            self.intake.set_aside(record, f"cannot process batch {message.batch_id}: {exc}")
            self.offsets.commit(record)
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
        self.offsets.defer(record)

        def set_aside(exc: OutputError) -> None:  # nothing was sent: the input is dead-lettered with why, and committed
            nonlocal outcome, outputs
            self.intake.set_aside(record, f"cannot process batch {message.batch_id}: {exc}")
            outcome, outputs = "dead_letter", []

        self._save_send_commit(record, outputs, unencodable=set_aside)
        seconds = time.perf_counter() - started
        # Response tokens handled: those read downstream, those generated by the generator.
        made = (output.response_tokens_total for output in outputs if isinstance(output, BatchMessage))
        tokens = message.response_tokens_total or sum(made)
        if outcome != "dead_letter":  # counted as it was set aside
            self.count(outcome, message.rows, seconds, tokens)
        self.metrics.lag.labels(self.service.role).set(self.work.lag())

    def _tick(self) -> bool:
        """What the service takes up on time alone (:meth:`Service.tick`): its state made durable, then its outputs
        sent, as for an input. Returns whether there were any."""
        with self.timed("compute"), self.uninterrupted():
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
            with self.timed("checkpoint"), self.uninterrupted():
                durable = self.offsets.durable()
        try:
            with self.timed("produce"):
                self.sender.send(outputs)
            self.counters["produced"] += len(outputs)
        except OutputError as exc:
            if unencodable is None:
                raise
            unencodable(exc)  # nothing was sent
        except BaseException:
            self.unsent = (record, outputs, durable)
            raise
        if durable:
            with self.timed("commit"):
                self.offsets.commit_deferred()

    def _send_unsent(self) -> None:
        """Send the outputs whose sending failed (raises again while the broker is away), then commit their input."""
        record, outputs, durable = self.unsent
        self.unsent = None
        self._save_send_commit(record, outputs, durable)
        of = f"{record.topic}[{record.partition}]@{record.offset}" if record is not None else "a tick"
        log.info("%s: outputs of %s sent again", self.replica_id, of)

    def _release_stuck(self) -> bool:
        """Dead-letter the held record furthest ahead once nothing could be processed for ``hold_timeout_s``
        (:meth:`HeldInputs.take_stuck`). Returns whether one was."""
        stuck = self.held.take_stuck(self.last_progress)
        if stuck is None:
            return False
        why = self.service.waiting_for(stuck.message) or "held"
        waited = time.monotonic() - stuck.since
        self.intake.set_aside(stuck.record, f"held {waited:.0f} s ({why}) while no input could be processed")
        self.offsets.commit(stuck.record)
        self.last_progress = time.monotonic()
        return True

    # ------------------------------------------------------------------ what passes through

    # status() keys, by outcome; the same outcomes label streamppo_batches_total.
    _COUNTER_KEYS = {
        "processed": "processed",
        "dropped": "dropped",
        "duplicate": "duplicates",
        "dead_letter": "dead_letters",
        "other_run": "other_runs",
    }

    def count(self, outcome: str, sequences: int = 0, seconds: float | None = None, tokens: int = 0) -> None:
        self.counters[self._COUNTER_KEYS[outcome]] += 1
        if tokens:
            self.counters["tokens"] += tokens
        self.metrics.count(outcome, sequences, seconds, tokens)

    @contextmanager
    def timed(self, part: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - started

    # ------------------------------------------------------------------ what it says

    def time_breakdown(self) -> dict[str, float]:
        """Seconds since start spent in each part of the loop; ``wait`` is the rest (polling, held, idle).

        ``compute`` is the service's core (models), ``produce`` encoding and sending, ``decode`` decoding input.
        """
        parts = {k: round(v, 3) for k, v in self.seconds.items()}
        parts["wait"] = round(time.perf_counter() - self.started - sum(self.seconds.values()), 3)
        return parts

    def status(self) -> dict:
        """Counters plus the consumer lag (:func:`.status.counters_and_lag`)."""
        return reports.counters_and_lag(self)

    def waiting_for(self) -> str:
        """What this replica waits for, in one line (:func:`.status.waiting_for`)."""
        return reports.waiting_for(self)

    def publish_status(self, state: str | None = None, counters: dict | None = None) -> ReplicaStatus:
        """Say what this replica is doing on the status topic (:func:`.status.replica_status`); returns the report."""
        report = reports.replica_status(self, state, counters)
        self.producer.send(STATUS_TOPIC, encode(report), key=self.replica_id.encode())
        self.producer.flush()
        return report

    # ------------------------------------------------------------------ the end (driven by the Replica)

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
                self.offsets.forget(self.unsent[0].partition)
            self.settled = self.offsets.durable(force=True)

    def disconnect(self) -> None:
        """The broker's part of closing, after :meth:`settle`: commit what the durable state covers, close the
        clients (a group member leaves its group)."""
        if self.settled:
            self.offsets.commit_deferred()
        self.producer.close()
        if self.work is not None:
            self.work.close()
        if self.weights is not None:
            self.weights.close()
        for channel in self.channels.values():
            channel.close()
