"""A bounded memory of the idempotency keys already handled (batch ids, group keys): how re-deliveries are recognised.

Delivery is at-least-once, so a batch can come back (after a crash before its commit, or produced twice by two
replicas of a stage). A duplicate arrives close to the original in practice; one that comes back more than
``size`` batches later is not recognised here, and for the learner the staleness rule then drops it, since its
policy version is long behind. The memory therefore never grows with the run, nor does the checkpoint that
holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["DEFAULT_WINDOW", "RecentIds"]

DEFAULT_WINDOW = 4096


class RecentIds:
    """The last ``size`` batch ids added, oldest forgotten first."""

    def __init__(self, size: int = DEFAULT_WINDOW, ids: Iterable[str] = ()):
        if size < 1:
            raise ValueError(f"a window of {size} ids remembers nothing")
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()
        for batch_id in ids:
            self.add(batch_id)

    def __contains__(self, batch_id: str) -> bool:
        return batch_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, batch_id: str) -> None:
        self._ids[batch_id] = None
        self._ids.move_to_end(batch_id)
        if len(self._ids) > self.size:
            self._ids.popitem(last=False)

    def to_list(self) -> list[str]:
        """Oldest first, as :class:`RecentIds` takes them back."""
        return list(self._ids)
