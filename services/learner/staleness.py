"""The learner's book of the staleness bound: what each recent version's announcements let generators take, which
versions a group can truly have been sampled by, and the wait for a group in flight that an update would leave
too stale.

Generators (and gateways) take the group at feed position p (``step × batch_size + row``) once an announcement of
version u says the learner has used up ``done`` groups with p < done + (max_staleness + 1) × groups_per_update; the
learner remembers ``done`` per recent version (:attr:`StalenessBook.done_at`) and reasons from it alone: it never
asks a generator what it took.
"""

from __future__ import annotations

import logging
import time

from common.config import RunConfig
from common.schema import ExperienceBatch
from services.learner.groups import StepLedger

log = logging.getLogger(__name__)

__all__ = ["StalenessBook"]


class StalenessBook:
    def __init__(self, config: RunConfig, replica_id: str):
        self.config, self.replica_id = config, replica_id
        self.done_at: dict[int, int] = {0: 0}  # per recent version: the groups used up its announcements said
        self.waiting_since: float | None = None  # since when the next update waits for a group in flight

    @property
    def _window(self) -> int:
        """Groups a generator may take beyond those used up: (max_staleness + 1) updates' worth."""
        return (self.config.pipeline.max_staleness + 1) * self.config.groups_per_update

    def announced(self, version: int, groups_done: int) -> None:
        """Remember what the newest announcement of ``version`` let generators take; forget what no group still
        trainable can have been taken by."""
        self.done_at[version] = groups_done
        oldest = version - self.config.pipeline.max_staleness - 1
        self.done_at = {v: done for v, done in self.done_at.items() if v >= oldest}

    def possible_version(self, version: int, current: int) -> bool:
        """Whether this learner (at ``current``), or its predecessor rolled back by a crash, can have announced
        ``version``: at most ``checkpoint_every`` records since the checkpoint, each of which may complete several
        updates."""
        per_record = -(-self.config.data.batch_size // self.config.groups_per_update)
        return version <= current + self.config.learner.checkpoint_every * per_record

    def never_admitted(self, message: ExperienceBatch, current: int) -> str:
        """Why a group of ``message`` cannot have been sampled by the version it says ('' when all can): a generator
        takes the group at feed position p only once an announcement of version u allowed it, and its oldest token
        is of u or later. Checked against the versions whose announced progress this learner still knows (a
        rolled-back predecessor's, above ``current``, are not), with a margin for what a predecessor may have
        announced of the same version after the checkpoint this one took up (the groups of the records since: at
        most checkpoint_every updates' and prompt batches' worth)."""
        batch = self.config.data.batch_size
        margin = (self.config.learner.checkpoint_every + 1) * (self.config.groups_per_update + batch)
        versions = message.row_versions()
        for index in message.groups():
            version = int(versions[message.group_index == index].min())
            done = self.done_at.get(version)
            if done is None or version > current:
                continue
            position = message.step * batch + int(index)
            if position >= done + self._window + margin:
                return (
                    f"group {message.step}/{index} cannot have been sampled by v{version}: its announcements let "
                    f"generators take feed positions below {done + self._window + margin}, and it is at {position}"
                )
        return ""

    def taken_at(self, position: int) -> int:
        """The earliest version whose announced progress let a generator take the group at feed ``position``."""
        return min((v for v, done in self.done_at.items() if done + self._window > position), default=0)

    def waits_for_in_flight(self, ledger: StepLedger, current: int, update: int) -> bool:
        """Whether ``update`` (the next) waits for a group still in flight that was fed before groups that arrived,
        and that the update would leave past max_staleness: it was taken by a generator at the earliest version whose
        announced progress allowed it. Waiting keeps long answers, which shorter ones overtake, from being dropped
        for their length. It ends when the group comes, or after pipeline.hold_timeout_s."""
        k = self.config.pipeline.max_staleness
        allowed = max(self.done_at.values()) + self._window  # beyond it, nothing can be in flight
        # Taken at the version k behind: trainable now, past the bound after this update. (Taken earlier, it is
        # past the bound already, and waiting would not save it.)
        at_risk = [position for position in ledger.unsettled(allowed) if self.taken_at(position) == current - k]
        if not at_risk:
            self.waiting_since = None
            return False
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
            log.info(
                "%s: update %d waits for %d groups in flight (the first: step %d, row %d)",
                self.replica_id,
                update,
                len(at_risk),
                *divmod(at_risk[0], self.config.data.batch_size),
            )
        if now - self.waiting_since < self.config.pipeline.hold_timeout_s:
            return True
        log.warning(
            "%s: %d groups in flight for %.0f s; update %d goes on without them",
            self.replica_id,
            len(at_risk),
            now - self.waiting_since,
            update,
        )
        self.waiting_since = None
        return False
