"""A consumer group that wedges (members that join and never get an assignment, kafka-python's eager rebalance
against a member that left mid-join) is left for a new generation of it, with its committed offsets."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from kafka import KafkaConsumer
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

if TYPE_CHECKING:
    from services.transport.kafka.bus import KafkaBus

log = logging.getLogger(__name__)


WEDGED_AFTER_S = 10.0  # the least time without an assignment, over several joins, that counts as a wedged group
WEDGED_JOINS = 3  # joins that completed, and never became an assignment, in that time


class GroupGenerations:
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


class WedgeWatch:
    """Notices a consumer group that has members but never deals out its partitions, and moves to a new one.

    The local broker (tansu 0.6) has a group bug: when a group's follower leaves and then its leader leaves
    mid-rebalance, it keeps naming the departed leader in every JoinGroup response, its SyncGroup answers "rebalance
    in progress" for ever, and no member (nor a new one, nor a new member id) gets a partition again
    (``tests/services/transport/test_kafka_bus.py`` reproduces it with plain clients). Only another group name
    escapes it. The sign: joins keep completing but no assignment follows, for longer than a few sessions. A member
    that waits for a busy one to rejoin (a legitimate long rebalance) completes no join meanwhile, and one with no
    partition because the group has more members than partitions has a stable assignment: neither is taken for the
    wedge.
    """

    def __init__(self, groups: GroupGenerations, connect, wedged_after_s: float):
        self.groups, self.connect, self.wedged_after_s = groups, connect, wedged_after_s
        self.unassigned_since: float | None = None
        self.joins, self.last_generation = 0, None

    def check(self, consumer: KafkaConsumer) -> KafkaConsumer:
        """``consumer``, or a consumer of the group's next generation when it is wedged."""
        if consumer.assignment():
            self.unassigned_since = None
            return consumer
        now = time.monotonic()
        # kafka-python counts no joins; its coordinator makes a new generation object on every completed join.
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
