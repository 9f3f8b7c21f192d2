"""The offset ledger of one replica's input: what may be committed, and when.

Kafka commits a partition up to an offset: committing a record commits every record before it. A record is
committed only once it is done and the service's state covers it (:meth:`~services.service.Service.make_durable`,
a learner's checkpoint), and never past a record of its partition still kept aside (held for newer weights, or a
streaming service's input in flight): that one must come again after a restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from services.runtime.dedupe import RecentIds
from services.runtime.referenced_batches import ReferencedBatches
from services.service import Progress, Service
from services.transport import Consumer, Record

__all__ = ["Offsets"]


class Offsets:
    """Per input partition, the newest record handled but not yet committed (``uncommitted``).

    ``aside()``: the records kept aside (held or in flight), below which nothing of their partition is committed.
    """

    def __init__(
        self,
        service: Service,
        work: Consumer,
        referenced: ReferencedBatches,
        recent: RecentIds,
        log: str,
        aside: Callable[[], Iterable[Record]],
    ):
        self.service, self.work, self.referenced, self.recent, self.log = service, work, referenced, recent, log
        self.aside = aside
        self.uncommitted: dict[int, Record] = {}

    def commit(self, record: Record) -> None:
        """Commit ``record``, but never past state the service has not made durable."""
        self.defer(record)
        if self.durable():
            self.commit_deferred()

    def defer(self, record: Record) -> None:
        """``record`` is done; it is committed with the next durable state. Every input record of its partition
        waits with it: a later record's commit would also commit an earlier, not yet durable one."""
        pending = self.uncommitted.get(record.partition)
        if pending is None or record.offset > pending.offset:
            self.uncommitted[record.partition] = record

    def forget(self, partition: int) -> None:
        """Nothing of ``partition`` handled since the last commit is committed (its outputs are not all out)."""
        self.uncommitted.pop(partition, None)

    def done_below(self, pending: Record) -> int:
        """The offset below which the partition of ``pending`` (handled) is done: past ``pending``, unless a record
        before it is kept aside."""
        aside = [record.offset for record in self.aside() if record.partition == pending.partition]
        return min([pending.offset + 1, *aside])

    def durable(self, force: bool = False) -> bool:
        """Whether the service's state covers what is done (made durable now if it is due, or ``force``)."""
        offsets = {f"{r.topic}/{r.partition}": self.done_below(r) for r in self.uncommitted.values()}
        return not offsets or self.service.make_durable(Progress(offsets, self.recent.to_list(), self.log), force)

    def commit_deferred(self) -> None:
        """Commit every partition as far as it is done (the state is durable)."""
        for partition, pending in list(self.uncommitted.items()):
            below = self.done_below(pending)
            if below > 0:
                # The last record done, not past what is aside.
                done = pending if below == pending.offset + 1 else dataclasses.replace(pending, offset=below - 1)
                self.work.commit(done)
                self.referenced.release(done)
            if below == pending.offset + 1:
                del self.uncommitted[partition]
