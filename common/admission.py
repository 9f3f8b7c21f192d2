"""Bounded staleness where sampling starts, counted in groups: what the generator (and, in a gateway run, the gateway)
may begin to sample given the learner's progress.

A group (a prompt's ``n`` responses, fed as row ``row`` of prompt batch ``step``) may begin once it is within
``(max_staleness + 1)`` updates' worth of groups of what the learner has used up (trained, or dropped), which every
actor announcement carries (``learner.groups_done``): it is then trained within ``max_staleness`` versions of the
policy that samples it, however many groups each update takes or drops.
"""

from __future__ import annotations

from common.config import RunConfig

__all__ = ["Admission"]


class Admission:
    def __init__(self, config: RunConfig):
        self.batch_size = config.data.batch_size
        self.per_update = config.groups_per_update
        self.max_staleness = config.pipeline.max_staleness
        self.prompt_batches = config.steps_possible  # the run's own, and those that replace groups too stale
        self.groups_done = 0  # groups the learner had used up when it announced the newest weights seen

    def admits(self, step: int, row: int) -> bool:
        """Whether the group of ``row`` of prompt batch ``step`` may be sampled now."""
        return self.groups_before(step) + row < self.admissible()

    def admits_batch(self, step: int) -> bool:
        """Whether a prompt batch may be taken: its first group may be sampled (waiting for all of them could wait
        for good: the learner holding part of an update, needing this batch to finish it). A step outside the run is
        let through, for the service to refuse: held, it would wait for good."""
        return not 0 <= step < self.prompt_batches or self.admits(step, 0)

    def groups_before(self, step: int) -> int:
        """Groups fed before prompt batch ``step``."""
        return step * self.batch_size

    def admissible(self) -> int:
        """Groups that may have been fed: those used up, and (max_staleness + 1) updates' worth more."""
        return self.groups_done + (self.max_staleness + 1) * self.per_update

    def waiting_for(self, step: int, version: int) -> str:
        enough = self.groups_before(step) - self.admissible() + self.groups_done
        return (
            f"prompt batch {step} waits for the learner to have used up more than {enough} groups (it has used up "
            f"{self.groups_done}, actor v{version})"
        )
