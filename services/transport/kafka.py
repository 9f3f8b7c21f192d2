"""The bus over Kafka (kafka-python): any Kafka-protocol broker, Apache Kafka in production.

Settings are chosen to be valid on Apache Kafka and on the small test broker alike:

- producer: ``acks=all`` with idempotence, so a retried send is not written twice;
- consumers: manual commits only (the runner commits after the batch's output is flushed), ``earliest``
  reset for groups, so a new group starts at the beginning of the log; partitions dealt round-robin among a
  group's members, so that consecutive steps (on consecutive partitions, ``common.schema.message_partition``)
  go to different replicas and can be worked on at once (kafka-python's default deals each member a block);
- broadcast readers (``group=None``) join no group: they are assigned every partition of the topic and read it
  from the beginning at each start, so a restart leaves no orphan group on the broker, and they never commit;
- lag is the fetch high-watermark minus the position (``ListOffsets`` is not trusted).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from kafka.errors import KafkaError, KafkaTimeoutError, NoBrokersAvailable, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata

from services.transport.base import Bus, Consumer, LogMissing, Producer, Record, TopicMismatch, TopicSpec

log = logging.getLogger(__name__)

__all__ = ["BrokerUnavailable", "KafkaBus", "KafkaSettings", "min_insync_replicas"]


ANSWER_TIMEOUT_S = 5.0  # how long a log identity check waits for the broker's answer (it takes milliseconds)


def min_insync_replicas(replication: int) -> int:
    """The copies a write must reach (with the producers' acks=all) before it counts as sent: 2 of 3 or more, so
    that one broker's loss neither loses an acknowledged record nor stops writes; 1 of 1 or 2."""
    return 2 if replication >= 3 else 1


class BrokerUnavailable(ConnectionError):
    """The broker could not be reached within the connect timeout."""


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap: str
    max_message_bytes: int = 64 * 1024 * 1024
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 1000
    max_poll_interval_ms: int = 600_000  # one batch of model compute may take minutes
    replication_factor: int | None = None  # None: the cluster's (KafkaBus._cluster_replication)
    connect_timeout_s: float = 30.0
    idempotent_producer: bool = True
    fetch_max_wait_ms: int = 100  # how long the broker may hold an empty fetch (see KafkaSection)
    # Preferred first; range second, so a group with members of an older build still agrees on one.
    partition_assignment: tuple = (RoundRobinPartitionAssignor, RangePartitionAssignor)
    # Passed through to kafka-python (security_protocol, sasl_*, ssl_*); holds secrets, so never printed.
    security: dict = field(default_factory=dict, repr=False)


class KafkaBus(Bus):
    def __init__(self, settings: KafkaSettings):
        self.settings = settings
        self._common = {
            "bootstrap_servers": settings.bootstrap.split(","),
            # One connection attempt; _retrying() repeats it with back-off up to connect_timeout_s.
            "api_version_auto_timeout_ms": int(min(settings.connect_timeout_s, 10.0) * 1000),
            # kafka-python refuses network frames over 1 MB by default; a fetch carries up to max_message_bytes.
            "receive_message_max_bytes": settings.max_message_bytes + (1 << 20),
            # A broker that lost its data must not make topics with its defaults because a client named one: the
            # run's topics are made by create_topics alone, and a service that finds them gone stops.
            "allow_auto_create_topics": False,
            **settings.security,
        }
        self._identity_probe: KafkaConsumer | None = None

    def _retrying(self, what: str, connect):
        """Connect with back-off until ``connect_timeout_s``: a broker that is still starting is not an error."""
        deadline = time.monotonic() + self.settings.connect_timeout_s
        delay, said = 0.2, False
        while True:
            try:
                return connect()
            except (NoBrokersAvailable, KafkaTimeoutError):
                if time.monotonic() + delay > deadline:
                    raise BrokerUnavailable(
                        f"no Kafka broker reachable at {self.settings.bootstrap} after "
                        f"{self.settings.connect_timeout_s:.0f}s ({what}; kafka.connect_timeout_s sets how long)"
                    ) from None
                if not said:  # once: a broker that is still starting is the common case
                    log.warning(
                        "broker %s not reachable yet (%s); retrying for up to %.0f s",
                        self.settings.bootstrap,
                        what,
                        self.settings.connect_timeout_s,
                    )
                    said = True
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def create_topics(self, specs: list[TopicSpec], replace_wrong: bool = False) -> None:
        probe = self._retrying("metadata", self._metadata_probe)
        try:
            existing = probe.topics()
            partitions = {spec.name: probe.partitions_for_topic(spec.name) for spec in specs if spec.name in existing}
            brokers = {broker.nodeId for broker in probe._client.cluster.brokers()}
        finally:
            probe.close()
        missing = [spec for spec in specs if spec.name not in existing]
        kept = [spec for spec in specs if spec.name in existing and spec.verify]
        if not missing and not kept:
            return
        admin = self._retrying("admin", lambda: KafkaAdminClient(client_id="streamppo-admin", **self._admin_options()))
        try:
            wrong = self._wrong_topics(admin, kept, partitions)
            if wrong and not replace_wrong:
                raise TopicMismatch(
                    f"{'; '.join(wrong.values())}: the broker made it on its own (a new, empty broker?). "
                    "`streamppo topics` (or `streamppo up`) replaces it."
                )
            if wrong:
                log.warning("replacing %s", "; ".join(wrong.values()))
                admin.delete_topics(list(wrong))
                self._wait_until_gone(list(wrong))
                missing += [spec for spec in kept if spec.name in wrong]
            replication = self.settings.replication_factor or self._cluster_replication(admin, brokers)
            for spec in missing:
                configs = {
                    "max.message.bytes": str(self.settings.max_message_bytes),
                    "cleanup.policy": "compact" if spec.compacted else "delete",
                }
                if replication > 1:
                    configs["min.insync.replicas"] = str(min_insync_replicas(replication))
                if not spec.compacted:
                    if spec.retention_ms is not None:
                        configs["retention.ms"] = str(spec.retention_ms)
                    if spec.retention_bytes is not None:
                        configs["retention.bytes"] = str(spec.retention_bytes)
                configs.update(spec.settings)
                topic = NewTopic(spec.name, spec.partitions, replication, topic_configs=configs)
                try:
                    admin.create_topics([topic])
                except TopicAlreadyExistsError:
                    pass  # another process created it first
        finally:
            admin.close()

    @staticmethod
    def _cluster_replication(admin: KafkaAdminClient, brokers: set[int]) -> int:
        """The replication of topics made without ``kafka.replication_factor``: the brokers'
        ``default.replication.factor``, but at least min(3, brokers) (Kafka's own default of 1 would leave one
        broker's loss losing partitions), and never more than the brokers."""
        said = 1
        try:
            resources = [ConfigResource(ConfigResourceType.BROKER, str(min(brokers)))]
            for response in admin.describe_configs(resources):
                for resource in response.resources:
                    value = str({entry[0]: entry[1] for entry in resource[4]}.get("default.replication.factor", ""))
                    said = int(value) if value.isdigit() else said
        except (KafkaError, ValueError, IndexError) as exc:  # a broker that does not describe its configs
            log.debug("default.replication.factor not read (%s): taking min(3, brokers)", exc)
        return min(len(brokers), max(said, min(3, len(brokers))))

    def replication(self, topics: list[str]) -> tuple[int, dict[str, int]]:
        brokers, partitions = self._cluster_metadata(topics)
        return len(brokers), {
            topic: min(len(p.replicas) for p in found.values()) for topic, found in partitions.items() if found
        }

    def _cluster_metadata(self, topics: list[str]) -> tuple[set[int], dict[str, dict]]:
        """The brokers' ids and, of ``topics`` that exist, each partition's metadata (its replicas), from a fresh
        metadata request (the admin client's describe calls parse ACL fields not every broker fills in)."""
        probe = self._retrying("metadata", self._metadata_probe)
        try:
            existing = self._topics(probe)
            cluster = probe._client.cluster
            return {broker.nodeId for broker in cluster.brokers()}, {
                topic: dict(cluster._partitions.get(topic, {})) for topic in topics if topic in existing
            }
        finally:
            probe.close()

    @staticmethod
    def _wrong_topics(admin: KafkaAdminClient, specs: list[TopicSpec], partitions: dict) -> dict[str, str]:
        """Existing topics to verify (the weights topic) whose partitions or cleanup policy are wrong: name -> why.

        A broker that lost its topics creates them again on the first request that names them, with its defaults:
        the weights topic would then keep every announcement, over several partitions.
        """
        if not specs:
            return {}
        resources = [ConfigResource(ConfigResourceType.TOPIC, spec.name) for spec in specs]
        policies = {}
        for response in admin.describe_configs(resources):
            for resource in response.resources:
                _, _, _, name, entries = resource
                policies[name] = {entry[0]: entry[1] for entry in entries}.get("cleanup.policy", "")
        wrong = {}
        for spec in specs:
            count, policy = len(partitions.get(spec.name) or ()), policies.get(spec.name, "?")
            if count != spec.partitions or ("compact" in policy) != spec.compacted:
                wrong[spec.name] = (
                    f"topic {spec.name} has {count} partition(s) and cleanup.policy={policy}, but must have "
                    f"{spec.partitions}{' and be compacted' if spec.compacted else ''}"
                )
        return wrong

    def close(self) -> None:
        if self._identity_probe is not None:
            self._identity_probe.close()
            self._identity_probe = None

    def _admin_options(self) -> dict:
        """The admin client makes topics on purpose; it takes no auto-creation switch."""
        return {k: v for k, v in self._common.items() if k != "allow_auto_create_topics"}

    def _metadata_probe(self, group_id: str | None = None) -> KafkaConsumer:
        """A client for metadata requests only (the admin client's list_topics() also parses ACL fields that not
        every broker fills in the way kafka-python expects), or with ``group_id`` for a group's committed offsets: it
        never joins the group."""
        return KafkaConsumer(client_id="streamppo-admin", group_id=group_id, enable_auto_commit=False, **self._common)

    def _wait_until_gone(self, names: list[str], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            probe = self._metadata_probe()
            try:
                if not set(names) & probe.topics():
                    return
            finally:
                probe.close()
            time.sleep(0.2)
        raise TopicMismatch(f"topics {names} were deleted but still exist after {timeout_s:.0f} s")

    def log_identity(self, topic: str, create: bool = False) -> str | None:
        # One probe for the bus's life: a service asks every few seconds.
        if self._identity_probe is None:
            self._identity_probe = self._retrying("metadata", self._metadata_probe)
        probe = self._identity_probe
        if topic not in self._topics(probe):  # a fresh metadata request: a topic the broker lost is gone from it
            if not create:
                return None
            self._await_topic(probe, topic)  # made a moment ago (create_topics), not yet in every broker's metadata
        tp = TopicPartition(topic, 0)
        probe.assign([tp])
        probe.seek_to_beginning(tp)
        first = self._first_record(probe, tp)
        if first is None and create:
            producer = KafkaProducer(acks="all", **self._common)
            try:
                identity = uuid.uuid4().hex.encode()  # its own key: compaction keeps every writer's record
                written = producer.send(topic, identity, key=identity, partition=0).get(timeout=30)
            finally:
                producer.close()
            if written.offset == 0:  # the first record is this one
                return identity.decode()
            # Another process wrote first. Its record is there: the probe's high watermark, from its fetch before,
            # still says the partition is empty (read as "no identity", a replica once took the log for replaced).
            probe.seek_to_beginning(tp)
            first = self._first_record(probe, tp, written=True)
        return first

    def _await_topic(self, probe: KafkaConsumer, topic: str) -> None:
        """Return once the broker's metadata names ``topic``; raise :class:`LogMissing` after ``connect_timeout_s``."""
        deadline = time.monotonic() + self.settings.connect_timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.2)  # the caller has just asked
            if topic in self._topics(probe):
                return
        raise LogMissing(
            f"topic {topic} does not exist on {self.settings.bootstrap} after {self.settings.connect_timeout_s:.0f}s: "
            "the run's topics were not made (`streamppo topics` makes them) or the broker lost them"
        )

    @staticmethod
    def _topics(consumer: KafkaConsumer, timeout_s: float = ANSWER_TIMEOUT_S) -> set[str]:
        """Every topic's name, from a fresh metadata request. ``KafkaConsumer.topics()`` waits for the answer without
        a limit (kafka-python 2.3), for as long as the broker is away; this raises after ``timeout_s``."""
        client, cluster = consumer._client, consumer._client.cluster
        stash, cluster.need_all_topic_metadata = cluster.need_all_topic_metadata, True
        try:
            future = cluster.request_update()
            client.poll(timeout_ms=timeout_s * 1000, future=future)
        finally:
            cluster.need_all_topic_metadata = stash
        if not future.is_done:
            raise KafkaTimeoutError(f"no answer to a metadata request within {timeout_s:.0f} s")
        if future.failed():
            raise future.exception
        return set(cluster.topics())

    @staticmethod
    def _first_record(
        consumer: KafkaConsumer, tp: TopicPartition, timeout_s: float = ANSWER_TIMEOUT_S, written: bool = False
    ) -> str | None:
        """The value of the partition's first record with a value (a null one, which any client may write, names no
        log), or None once a fetch shows no such record (never when one is known to be ``written``). A broker that
        does not answer (it is away) raises: that is not an empty log, and no service may take it for one."""
        deadline, read_to = time.monotonic() + timeout_s, 0  # read_to: past the last record read (all null)
        while time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200, max_records=100).values():
                for record in records:
                    if record.value is not None:
                        return record.value.decode(errors="replace")
                    read_to = record.offset + 1
            # (Never position(): with a partition's leader away it blocks for as long as that lasts.)
            end = consumer.highwater(tp)
            if not written and end is not None and read_to >= end:
                return None
        raise KafkaTimeoutError(f"no answer to a fetch of {tp.topic} within {timeout_s:.0f} s")

    def producer(self, client_id: str) -> Producer:
        return _KafkaProducer(
            self._retrying(
                "producer",
                lambda: KafkaProducer(
                    client_id=client_id,
                    acks="all",
                    enable_idempotence=self.settings.idempotent_producer,
                    max_request_size=self.settings.max_message_bytes,
                    # A send to a topic the broker does not have (it lost its data) fails in seconds, not a minute.
                    max_block_ms=10_000,
                    **self._common,
                ),
            )
        )

    def consumer(self, topic: str, group: str | None, client_id: str) -> Consumer:
        s = self.settings

        def connect(group_id: str | None) -> KafkaConsumer:
            return self._retrying(
                "consumer",
                lambda: KafkaConsumer(
                    client_id=client_id,
                    group_id=group_id,
                    enable_auto_commit=False,
                    auto_offset_reset="earliest",
                    session_timeout_ms=s.session_timeout_ms,
                    heartbeat_interval_ms=s.heartbeat_interval_ms,
                    max_poll_interval_ms=s.max_poll_interval_ms,
                    fetch_max_bytes=s.max_message_bytes,
                    fetch_max_wait_ms=s.fetch_max_wait_ms,
                    max_partition_fetch_bytes=s.max_message_bytes,
                    partition_assignment_strategy=s.partition_assignment,
                    **self._common,
                ),
            )

        if group is None:
            kafka_consumer = connect(None)
            kafka_consumer.assign(self._partitions(kafka_consumer, topic))
            return _KafkaConsumer(kafka_consumer, topic, None, fetch_wait_s=s.fetch_max_wait_ms / 1000)
        groups = _GroupGenerations(self, topic, group)
        kafka_consumer = connect(groups.current())
        kafka_consumer.subscribe([topic])
        wedged_after_s = max(3 * s.session_timeout_ms / 1000, WEDGED_AFTER_S)
        return _KafkaConsumer(
            kafka_consumer,
            topic,
            groups.name,
            _WedgeWatch(groups, connect, wedged_after_s),
            fetch_wait_s=s.fetch_max_wait_ms / 1000,
        )

    def _partitions(self, consumer: KafkaConsumer, topic: str) -> list[TopicPartition]:
        """Every partition of ``topic``, once the broker's metadata names them (it may lag a topic's creation)."""
        deadline = time.monotonic() + self.settings.connect_timeout_s
        while True:
            partitions = consumer.partitions_for_topic(topic)
            if partitions:
                return [TopicPartition(topic, p) for p in sorted(partitions)]
            if time.monotonic() > deadline:
                raise BrokerUnavailable(f"topic {topic!r} has no partitions on {self.settings.bootstrap}")
            time.sleep(0.2)


WEDGED_AFTER_S = 10.0  # the least time without an assignment, over several joins, that counts as a wedged group
WEDGED_JOINS = 3  # joins that completed, and never became an assignment, in that time


class _GroupGenerations:
    """A consumer group and the groups its members moved to when it wedged: ``<group>``, ``<group>~1``, ...

    A group moved to gets the committed offsets of the one it replaces before anyone joins it, so the newest
    generation with committed offsets is the one in use: that is where a new member joins, and nothing committed is
    read again.
    """

    def __init__(self, bus: KafkaBus, topic: str, base: str):
        self.bus, self.topic, self.base, self.generation = bus, topic, base, 0

    @property
    def name(self) -> str:
        return self.base if self.generation == 0 else f"{self.base}~{self.generation}"

    def current(self) -> str:
        while self._committed(f"{self.base}~{self.generation + 1}"):
            self.generation += 1
        return self.name

    def move_on(self) -> str:
        """Move to the next generation, giving it this one's committed offsets (where no member did first)."""
        offsets = self._committed(self.name)
        self.generation += 1
        probe = self._probe(self.name)
        try:
            partitions = self.bus._partitions(probe, self.topic)
            if not any(probe.committed(tp) is not None for tp in partitions):
                probe.assign(partitions)
                starts = probe.beginning_offsets(partitions)
                probe.commit(
                    {tp: OffsetAndMetadata(offsets.get(tp.partition, starts[tp]), "", -1) for tp in partitions}
                )
        finally:
            probe.close()
        return self.name

    def _committed(self, group: str) -> dict[int, int]:
        probe = self._probe(group)
        try:
            committed = {tp.partition: probe.committed(tp) for tp in self.bus._partitions(probe, self.topic)}
        finally:
            probe.close()
        return {partition: offset for partition, offset in committed.items() if offset is not None}

    def _probe(self, group: str) -> KafkaConsumer:
        return self.bus._retrying("metadata", lambda: self.bus._metadata_probe(group))


class _WedgeWatch:
    """Notices a consumer group that has members but never deals out its partitions, and moves to a new one.

    The local broker (tansu 0.6) has a group bug: when a group's follower leaves and then its leader leaves
    mid-rebalance, it keeps naming the departed leader in every JoinGroup response, its SyncGroup answers "rebalance
    in progress" for ever, and no member (nor a new one, nor a new member id) gets a partition again
    (``tests/test_kafka.py`` reproduces it with plain clients). Only another group name escapes it. The sign: joins
    keep completing but no assignment follows, for longer than a few sessions. A member that waits for a busy one
    to rejoin (a legitimate long rebalance) completes no join meanwhile, and one with no partition because the
    group has more members than partitions has a stable assignment: neither is taken for the wedge.
    """

    def __init__(self, groups: _GroupGenerations, connect, wedged_after_s: float):
        self.groups, self.connect, self.wedged_after_s = groups, connect, wedged_after_s
        self.unassigned_since: float | None = None
        self.joins, self.last_generation = 0, None

    def check(self, consumer: KafkaConsumer) -> KafkaConsumer:
        """``consumer``, or a consumer of the group's next generation when it is wedged."""
        if consumer.assignment():
            self.unassigned_since = None
            return consumer
        now = time.monotonic()
        # kafka-python 2.3 counts no joins; its coordinator makes a new generation object on every completed join.
        generation = consumer._coordinator._generation
        if self.unassigned_since is None:
            self.unassigned_since, self.joins, self.last_generation = now, 0, generation
        elif generation is not self.last_generation:
            self.joins, self.last_generation = self.joins + 1, generation
        if now - self.unassigned_since < self.wedged_after_s or self.joins < WEDGED_JOINS:
            return consumer
        wedged = self.groups.name
        try:
            consumer.close()
        except KafkaError as exc:
            log.debug("leaving the wedged group %s: %s", wedged, exc)
        moved_to = self.groups.move_on()
        log.warning(
            "consumer group %s has given no partition of %s for %.0f s over %d joins (a broker bug: it names a "
            "departed leader); moving to group %s, with the committed offsets",
            wedged,
            self.groups.topic,
            now - self.unassigned_since,
            self.joins,
            moved_to,
        )
        self.unassigned_since = None
        fresh = self.connect(moved_to)
        fresh.subscribe([self.groups.topic])
        return fresh


class _KafkaProducer(Producer):
    def __init__(self, producer: KafkaProducer):
        self.producer = producer
        self.futures = []

    def send(self, topic: str, value: bytes | None, key: bytes | None = None, partition: int | None = None) -> None:
        self.futures.append(self.producer.send(topic, value=value, key=key, partition=partition))

    def partitions(self, topic: str) -> int:
        return len(self.producer.partitions_for(topic))

    def flush(self) -> None:
        self.producer.flush()
        futures, self.futures = self.futures, []
        for future in futures:
            future.get()  # raises the send's error: an unacknowledged output must not let the input be committed

    def close(self) -> None:
        self.flush()
        self.producer.close()

    def discard(self) -> None:
        self.futures = []
        sender = self.producer._sender  # kafka-python 2.3: close() flushes first, sending what is queued
        if sender is not None:
            sender.force_close()  # what is queued is failed, not sent
        try:
            self.producer.close(timeout=0)
        except KafkaError as exc:  # batches the sender has not failed yet
            log.debug("discarding a producer: %s", exc)


class _KafkaConsumer(Consumer):
    def __init__(
        self,
        consumer: KafkaConsumer,
        topic: str,
        group: str | None,
        wedge: _WedgeWatch | None = None,
        fetch_wait_s: float = 0.0,
    ):
        self.consumer, self.topic, self.group, self.wedge = consumer, topic, group, wedge
        self.fetch_wait_s = fetch_wait_s
        self.buffer: list[Record] = []

    def poll(self, timeout_s: float = 0.0, max_records: int = 1) -> list[Record]:
        if self.wedge is not None:
            self.consumer = self.wedge.check(self.consumer)
            self.group = self.wedge.groups.name
        if not self.buffer:
            # Never 0 ms: with a zero timeout kafka-python can keep sending fetches without ever reading one back.
            batches = self.consumer.poll(timeout_ms=max(int(timeout_s * 1000), 10), max_records=max_records)
            for records in batches.values():
                self.buffer.extend(
                    Record(r.topic, r.partition, r.offset, r.key, r.value, r.timestamp / 1000.0) for r in records
                )
        out, self.buffer = self.buffer[:max_records], self.buffer[max_records:]
        return out

    def pause(self, partition: int) -> None:
        # Records of this partition fetched but not yet returned are fetched again after resume.
        tp = TopicPartition(self.topic, partition)
        dropped = [r.offset for r in self.buffer if r.partition == partition]
        self.buffer = [r for r in self.buffer if r.partition != partition]
        if tp in self.consumer.assignment():
            if dropped:
                self.consumer.seek(tp, min(dropped))
            self.consumer.pause(tp)

    def resume(self, partition: int) -> None:
        tp = TopicPartition(self.topic, partition)
        if tp in self.consumer.assignment():
            self.consumer.resume(tp)

    def commit(self, record: Record) -> None:
        if self.group is None:
            return
        self.consumer.commit(
            {TopicPartition(record.topic, record.partition): OffsetAndMetadata(record.offset + 1, "", -1)}
        )

    def log_ends(self) -> dict[int, int]:
        ends = {tp.partition: self.consumer.highwater(tp) for tp in self.consumer.assignment()}
        return {partition: end for partition, end in ends.items() if end is not None}

    def assigned(self) -> set[int]:
        return {tp.partition for tp in self.consumer.assignment()}

    def at_end(self) -> bool:
        # An end offset is known once a fetch of the partition was answered; until then nothing says it is read.
        assigned = self.consumer.assignment()
        ends = {tp: self.consumer.highwater(tp) for tp in assigned}
        return (
            bool(assigned)
            and not self.buffer
            and all(end is not None and self.consumer.position(tp) >= end for tp, end in ends.items())
        )

    def lag(self) -> int:
        total = 0
        for tp in self.consumer.assignment():
            highwater = self.consumer.highwater(tp)
            if highwater is not None:
                total += max(highwater - self.consumer.position(tp), 0)
        return total

    def close(self) -> None:
        try:
            self.consumer.close()
        except KafkaError as exc:
            log.warning("closing consumer: %s", exc)
