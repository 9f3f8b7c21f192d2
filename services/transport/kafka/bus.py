"""The Kafka bus: its settings, its admin (topics made, checked and replaced; replication read from the cluster), the
log's identity, and the producers and consumers it makes (:mod:`.clients`)."""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka import errors as KafkaErrors
from kafka.admin import ConfigResource, ConfigResourceType, MemberToRemove, NewTopic
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.coordinator.assignors.roundrobin import RoundRobinPartitionAssignor
from kafka.errors import KafkaError, KafkaTimeoutError, TopicAlreadyExistsError

from services.transport.base import Bus, Consumer, LogMissing, Producer, TopicMismatch, TopicSpec
from services.transport.kafka.clients import KafkaBusConsumer, KafkaBusProducer
from services.transport.kafka.groups import WEDGED_AFTER_S, GroupGenerations, WedgeWatch

log = logging.getLogger(__name__)


ANSWER_TIMEOUT_S = 5.0  # how long a log identity check waits for the broker's answer (it takes milliseconds)
LEAVE_TIMEOUT_S = 3.0  # how long a closing static member tries to reach the brokers to leave its group


def min_insync_replicas(replication: int) -> int:
    """The copies a write must reach (with the producers' acks=all) before it counts as sent: 2 of 3 or more, so
    that one broker's loss neither loses an acknowledged record nor stops writes; 1 of 1 or 2."""
    return 2 if replication >= 3 else 1


def instance_id(member: str) -> str:
    """``member`` as a group.instance.id, which Kafka allows only ASCII letters, digits, '.', '_' and '-' in."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", member)[:249] or "_"


def making_no_topics(client):
    """``client`` (a producer or consumer), never making a topic by naming it: kafka-python 3.0.12 builds its
    metadata cache without the client's ``allow_auto_create_topics``, so its metadata requests ask the broker to
    make every topic they name."""
    cluster = client._client.cluster if isinstance(client, KafkaConsumer) else client._metadata
    cluster.config["allow_auto_create_topics"] = False
    return client


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
    request_timeout_ms: int = 5000  # a broker that answers nothing for this long is left for another (see KafkaSection)
    reconnect_backoff_max_ms: int = 1000  # a broker back (a cut healed) is reconnected to within this
    metadata_max_age_ms: int = 3000  # how stale a client's idea of the partitions' leaders may grow (see KafkaSection)
    idempotent_producer: bool = True
    fetch_max_wait_ms: int = 100  # how long the broker may hold an empty fetch (see KafkaSection)
    # Preferred first; range second, so a group with members of an older build still agrees on one. Not
    # kafka-python 3.0.12's cooperative-sticky: its groups were seen to rebalance every second for tens of seconds
    # while a member read nothing (docs/operating.md, "Kafka clients").
    partition_assignment: tuple = (RoundRobinPartitionAssignor, RangePartitionAssignor)
    static_members: bool = True  # a consumer named as a member joins with it as its group.instance.id (KIP-345)
    # Passed through to kafka-python (security_protocol, sasl_*, ssl_*); holds secrets, so never printed.
    security: dict = field(default_factory=dict, repr=False)


class KafkaBus(Bus):
    def __init__(self, settings: KafkaSettings):
        self.settings = settings
        self._common = {
            "bootstrap_servers": settings.bootstrap.split(","),
            # One connection attempt; _retrying() repeats it with back-off up to connect_timeout_s.
            "bootstrap_timeout_ms": int(min(settings.connect_timeout_s, 10.0) * 1000),
            # A broker that stops answering without closing its connections (its host lost, a link cut) is given up
            # on after the request timeout, and its partitions' new leaders looked up; kafka-python's 30 s would
            # stop the pipeline for as long. Its backoff between reconnects grows to 30 s, and a broker that
            # comes back would wait for it.
            "request_timeout_ms": settings.request_timeout_ms,
            "reconnect_backoff_max_ms": settings.reconnect_backoff_max_ms,
            # kafka-python 3 looks the leaders up again after a timed-out request only on this cadence (a timeout
            # is no metadata error to it): 5 minutes by default, for which a silent leader's partitions stay stuck.
            "metadata_max_age_ms": settings.metadata_max_age_ms,
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
            except KafkaTimeoutError:  # kafka-python 3: "Unable to bootstrap"
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
            brokers = {broker.node_id for broker in probe._client.cluster.brokers()}
        finally:
            probe.close()
        missing = [spec for spec in specs if spec.name not in existing]
        kept = [spec for spec in specs if spec.name in existing and spec.verify]
        if not missing and not kept:
            return
        admin = self._retrying("admin", self._admin)
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
            broker = str(min(brokers))
            described = admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, broker)], config_filter="all")
            value = str(described.get("broker", {}).get(broker, {}).get("default.replication.factor", {}).get("value"))
            said = int(value) if value.isdigit() else said
        except (KafkaError, ValueError) as exc:  # a broker that does not describe its configs
            log.debug("default.replication.factor not read (%s): taking min(3, brokers)", exc)
        return min(len(brokers), max(said, min(3, len(brokers))))

    def replication(self, topics: list[str]) -> tuple[int, dict[str, int]]:
        brokers, partitions = self._cluster_metadata(topics)
        return len(brokers), {
            topic: min(len(p.replica_nodes) for p in found.values()) for topic, found in partitions.items() if found
        }

    def _cluster_metadata(self, topics: list[str]) -> tuple[set[int], dict[str, dict]]:
        """The brokers' ids and, of ``topics`` that exist, each partition's metadata (its replicas), from a fresh
        metadata request (the admin client's describe calls parse ACL fields not every broker fills in)."""
        probe = self._retrying("metadata", self._metadata_probe)
        try:
            existing = self._topics(probe)
            cluster = probe._client.cluster
            return {broker.node_id for broker in cluster.brokers()}, {
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
        described = admin.describe_configs(resources, config_filter="all").get("topic", {})
        policies = {
            name: str(entries.get("cleanup.policy", {}).get("value", "")) for name, entries in described.items()
        }
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

    def _admin(self, bootstrap_timeout_s: float | None = None) -> KafkaAdminClient:
        """An admin client: it makes topics on purpose, and takes no auto-creation switch."""
        options = {k: v for k, v in self._common.items() if k != "allow_auto_create_topics"}
        if bootstrap_timeout_s is not None:
            options["bootstrap_timeout_ms"] = int(bootstrap_timeout_s * 1000)
        return KafkaAdminClient(client_id="streamppo-admin", **options)

    def _metadata_probe(self, group_id: str | None = None) -> KafkaConsumer:
        """A client for metadata requests only (the admin client's list_topics() also parses ACL fields that not
        every broker fills in the way kafka-python expects), or with ``group_id`` for a group's committed offsets: it
        never joins the group."""
        return making_no_topics(
            KafkaConsumer(client_id="streamppo-admin", group_id=group_id, enable_auto_commit=False, **self._common)
        )

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
            producer = making_no_topics(KafkaProducer(acks="all", **self._common))
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
        a limit, for as long as the broker is away; this raises :class:`KafkaTimeoutError` after ``timeout_s``. (The
        request runs on the consumer's IO thread, kafka-python 3's only driver of its connections.)"""
        cluster = consumer._client.cluster
        stash, cluster.need_all_topic_metadata = cluster.need_all_topic_metadata, True
        try:
            future = cluster.request_update()
            consumer._net.run(consumer._manager.wait_for, future, int(timeout_s * 1000))
        finally:
            cluster.need_all_topic_metadata = stash
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
        return KafkaBusProducer(
            self._retrying(
                "producer",
                lambda: making_no_topics(
                    KafkaProducer(
                        client_id=client_id,
                        acks="all",
                        enable_idempotence=self.settings.idempotent_producer,
                        max_request_size=self.settings.max_message_bytes,
                        # A send to a topic the broker does not have (it lost its data) fails in seconds, not a minute.
                        max_block_ms=10_000,
                        **self._common,
                    )
                ),
            )
        )

    def consumer(self, topic: str, group: str | None, client_id: str, member: str | None = None) -> Consumer:
        s = self.settings
        instance = instance_id(member) if member is not None and group is not None and s.static_members else None

        def connect(group_id: str | None) -> KafkaConsumer:
            return self._retrying(
                "consumer",
                lambda: making_no_topics(
                    KafkaConsumer(
                        client_id=client_id,
                        group_id=group_id,
                        group_instance_id=instance,
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
                    )
                ),
            )

        if group is None:
            kafka_consumer = connect(None)
            kafka_consumer.assign(self._partitions(kafka_consumer, topic))
            return KafkaBusConsumer(kafka_consumer, topic, None, fetch_wait_s=s.fetch_max_wait_ms / 1000)
        groups = GroupGenerations(self, topic, group)
        kafka_consumer = connect(groups.current())
        kafka_consumer.subscribe([topic])
        wedged_after_s = max(3 * s.session_timeout_ms / 1000, WEDGED_AFTER_S)
        return KafkaBusConsumer(
            kafka_consumer,
            topic,
            groups.name,
            WedgeWatch(groups, connect, wedged_after_s),
            fetch_wait_s=s.fetch_max_wait_ms / 1000,
            # A static member never leaves its group by closing (KIP-345): it is removed, as a dead one would be.
            leave=(lambda group: self._leave(instance, group)) if instance is not None else None,
        )

    def remove_member(self, member: str, within: str = "") -> list[str]:
        if not self.settings.static_members:
            return []  # no member has a lasting name to remove it by (nor may the broker describe groups well)
        instance = instance_id(member)
        admin = self._retrying("admin", self._admin)
        try:
            groups = [g["group_id"] for g in admin.list_groups() if g["group_id"].startswith(within)]
            holding = [
                name
                for name, described in (admin.describe_groups(groups) if groups else {}).items()
                if any(m.get("group_instance_id") == instance for m in described.get("members") or ())
            ]
            return self._remove(admin, instance, holding)
        finally:
            admin.close()

    def _leave(self, instance: str, group: str) -> None:
        """A closing static member removes itself: one attempt to reach the brokers for ``LEAVE_TIMEOUT_S`` (a
        replica that stops with the broker does not wait for it)."""
        admin = self._admin(LEAVE_TIMEOUT_S)
        try:
            self._remove(admin, instance, [group])
        finally:
            admin.close()

    @staticmethod
    def _remove(admin: KafkaAdminClient, instance: str, groups: list[str]) -> list[str]:
        """Remove the static member ``instance`` from ``groups``; those it was in."""
        removed = []
        for group in groups:
            try:
                answers = admin.remove_group_members(group, [MemberToRemove(group_instance_id=instance)])
            except KafkaError as exc:  # the group is gone, or its coordinator moved meanwhile
                log.warning("could not remove member %s from group %s: %s", instance, group, exc)
                continue
            if all(answer is KafkaErrors.NoError for answer in answers.values()):
                removed.append(group)
        return removed

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
