"""Whether the log a replica works on is still the one it started on.

A broker that lost its data (a new, empty one in its place) or topics made again leave a replica's offsets, its
consumer group and its memory of handled batches meaningless: :class:`~services.transport.LogReplaced` is raised,
and the replica leaves the lost log (:mod:`services.runtime.replica`).
"""

from __future__ import annotations

import time

from services.roles import LOG_TOPIC
from services.transport import Bus, Consumer, LogReplaced

__all__ = ["LOG_CHECK_S", "LogWatch"]

LOG_CHECK_S = 2.0  # how often a replica checks that its log is still the one it started on


class LogWatch:
    """Watches one replica's log (``log``: its identity, read as the replica joined)."""

    def __init__(self, bus: Bus, replica_id: str, log: str):
        self.bus, self.replica_id, self.log = bus, replica_id, log
        self.checked = time.monotonic()
        self.ends: dict[int, int] = {}  # per input partition: the highest end offset seen

    def check_identity(self) -> None:
        """Every few seconds: raises :class:`LogReplaced` when the broker lost the log (the identity is gone) or its
        topics were made again (another identity)."""
        if time.monotonic() - self.checked < LOG_CHECK_S:
            return
        self.checked = time.monotonic()
        now = self.bus.log_identity(LOG_TOPIC)
        if now != self.log:
            raise LogReplaced(
                f"{self.replica_id}: the log it worked on ({self.log}) is gone (the log's identity is now "
                f"{now or 'missing'}): the broker lost its data or its topics were made again"
            )

    def check_ends(self, work: Consumer, topic: str) -> None:
        """Raises :class:`LogReplaced` when ``work``'s partitions of ``topic`` end below where they had reached: the
        broker lost them."""
        shrunk = []
        for partition, end in sorted(work.log_ends().items()):
            reached = self.ends.get(partition, 0)
            if end < reached:
                shrunk.append(f"{topic}[{partition}] {reached} -> {end}")
            self.ends[partition] = end
        if shrunk:
            raise LogReplaced(
                f"{self.replica_id}: the broker lost its data (a new, empty broker?): log ends went back "
                f"({', '.join(shrunk)})"
            )
