"""The weights feed of one replica: the newest announcement of each model it loads, offered to its service.

Every replica that loads weights reads the whole ``weights`` topic on its own (no consumer group), so a late joiner
sees the newest announcement of each model. Of the announcements a poll brings, the newest version per model is
offered first; one the service refuses (a snapshot missing, damaged or forged) never counts as loaded, so the next
older one is tried, and a later announcement of the same version is still taken. An announcement of the version
loaded that says the learner used up more groups is offered too: it brings the learner's progress, which
generators admit prompt batches by, and nothing to load. Announcements of a learner epoch older than the weights
already loaded come from a learner that was replaced but still runs: they are ignored and counted. A newer epoch
supersedes whatever an older one announced, even at a lower version: a learner that restarts from its checkpoint
rolls back the updates its predecessor made since, and its announcements are the lineage from then on (weights of
the rolled-back versions, kept, would sample under version numbers the new learner gives to other weights).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager

from common.schema import LEARNER_GROUPS_DONE, WeightAnnouncement
from services.runtime.metrics import ServiceMetrics
from services.service import Service
from services.transport import Consumer, Record

log = logging.getLogger(__name__)

__all__ = ["WeightsFeed"]

MAX_RECORDS = 10_000  # announcements read at once (the newest of each model among them is offered)


class WeightsFeed:
    """``accept(record, type)`` decodes a record (dead-lettering what does not decode) and returns the message if it
    belongs to this run, else None; ``counters`` are the runner's (``refused_weights``, ``zombie_announcements``);
    ``timed(part)`` times a part of the runner's loop."""

    def __init__(
        self,
        service: Service,
        consumer: Consumer,
        accept: Callable[[Record, type], WeightAnnouncement | None],
        metrics: ServiceMetrics,
        counters: Counter,
        timed: Callable[[str], AbstractContextManager],
    ):
        self.service, self.consumer, self.accept = service, consumer, accept
        self.metrics, self.counters, self.timed = metrics, counters, timed
        self.loaded: dict[str, int] = {}  # per model: the version loaded
        self.progress: dict[str, tuple[int, int, int]] = {}  # per model: _progress of the newest taken
        self.caught_up = False  # the topic was read to its end once (see catch_up)

    def catch_up(self, within_s: float) -> bool:
        """Read the topic towards its end for up to about ``within_s``, offering what it holds; whether it has been
        read to its end (once: from then on, :meth:`apply`).

        A replica does this before it takes input: one started again (after a kill) would otherwise sample, score
        or value its first input with the initial weights while the announcement of the newest was still on its
        way, and what it sent would carry version 0 (a gateway's call answered so was too stale to train on)."""
        if self.caught_up:  # every poll asks
            return True
        deadline = time.monotonic() + within_s
        while not self.caught_up:
            records, self.caught_up = self.consumer.read_to_end(MAX_RECORDS)
            self._offer(records)
            if time.monotonic() >= deadline:
                break
        return self.caught_up

    def apply(self, timeout_s: float) -> bool:
        """Offer the service the newest announcements that arrived within ``timeout_s``; whether any was offered."""
        return self._offer(self.consumer.poll(timeout_s, max_records=MAX_RECORDS))

    def _offer(self, records: list[Record]) -> bool:
        candidates: dict[str, list[WeightAnnouncement]] = {}
        for record in records:
            announcement = self.accept(record, WeightAnnouncement)
            if announcement is not None and announcement.model in self.service.weight_models:
                candidates.setdefault(announcement.model, []).append(announcement)
        offered = False
        for model, announcements in candidates.items():
            for announcement in sorted(announcements, key=_progress, reverse=True):
                if self._from_a_replaced_learner(announcement):
                    continue
                if _progress(announcement) <= self.progress.get(model, (-1, -1, -1)):
                    break
                offered = True
                if self._load(announcement):
                    break
        return offered

    def _from_a_replaced_learner(self, announcement: WeightAnnouncement) -> bool:
        epoch, newest = _progress(announcement)[0], self.progress.get(announcement.model, (0,))[0]
        if epoch >= newest:
            return False
        self.counters["zombie_announcements"] += 1
        log.warning(
            "%s: ignoring %s v%d of learner epoch %d (epoch %d took over)",
            self.service.replica_id,
            announcement.model,
            announcement.policy_version,
            epoch,
            newest,
        )
        return True

    def _load(self, announcement: WeightAnnouncement) -> bool:
        with self.timed("load_weights"):
            loaded = self.service.on_weights(announcement)
        if not loaded:
            self.counters["refused_weights"] += 1
            return False
        self.loaded[announcement.model] = announcement.policy_version
        self.progress[announcement.model] = _progress(announcement)
        self.metrics.policy_version.labels(self.service.role).set(announcement.policy_version)
        return True

    def close(self) -> None:
        self.consumer.close()


def _progress(announcement: WeightAnnouncement) -> tuple[int, int, int]:
    """(learner epoch, version, groups used up): the order in which announcements supersede each other."""
    return (
        announcement.learner_epoch,
        announcement.policy_version,
        int(announcement.lineage.get(LEARNER_GROUPS_DONE, -1)),
    )
