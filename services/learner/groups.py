"""The learner's intake: experience arrives as groups (a prompt's ``n`` responses), and updates are made of them.

An update trains on ``learner.groups_per_update`` groups, whatever records carried them: a record may bring part
of an update, or several. Groups wait in a :class:`GroupBuffer`, oldest policy version first; a group that has
fallen more than ``max_staleness`` versions behind while it waited is dropped. The buffer is part of the learner's
checkpoint, with the input offsets that delivered it: after a crash nothing it held is lost or trained twice.

The :class:`StepLedger` says which prompt batches are settled (every group trained, waiting here, or dropped), so
that a run resumed on an empty broker publishes again exactly the prompt batches that are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common.schema import ExperienceBatch, group_key
from services.learner.experience import Experience

__all__ = ["Group", "GroupBuffer", "StepLedger", "groups_of"]


@dataclass(frozen=True)
class Group:
    """One prompt's responses, as they wait for an update."""

    step: int
    index: int  # the prompt's row in its batch
    version: int  # the oldest policy version that sampled a token of it
    batch_id: str  # the record that brought it
    seconds: dict[str, float]  # its share (by responses) of each stage's compute seconds for that record
    experience: Experience  # its n sequences

    @property
    def key(self) -> str:
        return group_key(self.step, self.index)


def groups_of(message: ExperienceBatch) -> list[Group]:
    """The groups a record carries, each with its share of the record's stage seconds."""
    experience = Experience.from_message(message)
    versions = message.row_versions()
    seconds = {k.removeprefix("seconds."): float(v) for k, v in message.lineage.items() if k.startswith("seconds.")}
    groups = []
    for index in message.groups():
        rows = torch.from_numpy(message.group_index == index).nonzero().flatten()
        share = len(rows) / max(message.rows, 1)
        groups.append(
            Group(
                message.step,
                index,
                int(versions[rows.numpy()].min()),  # judged by its oldest token
                message.batch_id,
                {stage: s * share for stage, s in seconds.items()},
                experience.take(rows),
            )
        )
    return groups


class GroupBuffer:
    """Groups waiting for an update, taken oldest version first (then by step and row: the order they were fed)."""

    FILE = "groups.pt"

    def __init__(self):
        self.groups: list[Group] = []

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, groups: list[Group]) -> None:
        self.groups.extend(groups)
        self.groups.sort(key=lambda g: (g.version, g.step, g.index))

    def drop_older_than(self, version: int) -> list[Group]:
        """Remove and return the groups sampled before ``version``."""
        stale = [g for g in self.groups if g.version < version]
        self.groups = [g for g in self.groups if g.version >= version]
        return stale

    def take(self, count: int) -> list[Group]:
        """The ``count`` oldest groups, removed from the buffer."""
        taken, self.groups = self.groups[:count], self.groups[count:]
        return taken

    def save(self, folder: Path) -> None:
        torch.save([_state(g) for g in self.groups], Path(folder) / self.FILE)

    def load(self, folder: Path) -> None:
        """Restore what :meth:`save` wrote; a checkpoint from before the buffer existed holds none."""
        path = Path(folder) / self.FILE
        self.groups = [_group(state) for state in torch.load(path, weights_only=True)] if path.exists() else []


def _state(group: Group) -> dict:
    return {
        "step": group.step,
        "index": group.index,
        "version": group.version,
        "batch_id": group.batch_id,
        "seconds": group.seconds,
        "experience": {name: getattr(group.experience, name) for name in Experience.__dataclass_fields__},
    }


def _group(state: dict) -> Group:
    return Group(
        state["step"],
        state["index"],
        state["version"],
        state["batch_id"],
        state["seconds"],
        Experience(**state["experience"]),
    )


class StepLedger:
    """Which prompt batches are settled: each of their ``batch_size`` groups trained, buffered or dropped."""

    def __init__(self, batch_size: int, below: int = 0, partial: dict[int, list[int]] | None = None):
        self.batch_size = batch_size
        self.below = below  # every prompt batch before this one is settled
        self.partial = {int(step): set(rows) for step, rows in (partial or {}).items()}

    def settle(self, step: int, rows: list[int]) -> None:
        if step < self.below:
            return
        self.partial.setdefault(step, set()).update(rows)
        while len(self.partial.get(self.below, ())) >= self.batch_size:
            del self.partial[self.below]
            self.below += 1

    def unsettled(self, below: int) -> list[int]:
        """Feed positions (``step × batch_size + row``) before ``below`` not settled yet, up to the newest settled
        one: groups fed before others that arrived, still in flight."""
        newest = max((step * self.batch_size + max(rows) + 1 for step, rows in self.partial.items()), default=0)
        missing = []
        for position in range(self.below * self.batch_size, min(below, newest)):
            step, row = divmod(position, self.batch_size)
            if row not in self.partial.get(step, ()):
                missing.append(position)
        return missing

    def state(self) -> dict:
        return {"below": self.below, "partial": {str(step): sorted(rows) for step, rows in self.partial.items()}}

    @classmethod
    def from_state(cls, batch_size: int, state: dict | None, default_below: int) -> StepLedger:
        """``default_below``: for a checkpoint from before the ledger, where one update trained one prompt batch."""
        if state is None:
            return cls(batch_size, default_below)
        return cls(batch_size, state["below"], {int(k): v for k, v in state["partial"].items()})
