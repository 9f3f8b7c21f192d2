"""Input records a service is not ready for (a prompt batch waiting for newer weights, experience of a later step),
kept aside uncommitted while reading goes on past them: the batch the pipeline needs next may sit behind one, in
its partition or another's (Kafka orders records within a partition only)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from common.schema import BatchMessage
from services.service import Service
from services.transport import Consumer, Record

__all__ = ["Held", "HeldInputs"]


@dataclass(frozen=True)
class Held:
    """An input record kept aside (uncommitted) since ``since``."""

    record: Record
    message: BatchMessage
    since: float  # time.monotonic()


class HeldInputs:
    """The records kept aside of one replica's input. With ``pipeline.held_per_partition`` of a partition kept
    aside, the partition is paused until one of them is taken."""

    def __init__(self, service: Service, work: Consumer | None):
        self.service, self.work = service, work
        self.records: list[Held] = []

    def __iter__(self) -> Iterator[Held]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def keep(self, record: Record, message: BatchMessage) -> None:
        self.records.append(Held(record, message, time.monotonic()))
        if sum(held.record.partition == record.partition for held in self.records) >= self.limit:
            self.work.pause(record.partition)

    @property
    def limit(self) -> int:
        return self.service.config.pipeline.held_per_partition

    def take_ready(self) -> Held | None:
        """The held record of the earliest step the service is ready for now, taken out; None if there is none."""
        ready = [held for held in self.records if self.service.ready_for(held.message)]
        return self._take(min(ready, key=lambda held: held.message.step)) if ready else None

    def take_stuck(self, last_progress: float) -> Held | None:
        """The held record furthest ahead, taken out, once nothing could be processed for
        ``pipeline.hold_timeout_s`` (since ``last_progress``) and it waited that long itself; else None.

        Every held record waiting that long, and no input handled meanwhile, means the partitions are blocked: a
        record that waits for something that never comes (a forged far-future step) keeps the records behind it
        in its partition, which may be the ones the pipeline needs, from ever being read.
        """
        limit, now = self.service.config.pipeline.hold_timeout_s, time.monotonic()
        if not self.records or now - last_progress < limit:
            return None
        stuck = max(self.records, key=lambda held: (held.message.step, -held.since))
        return self._take(stuck) if now - stuck.since >= limit else None

    def _take(self, held: Held) -> Held:
        self.records.remove(held)
        self.work.resume(held.record.partition)
        return held

    def oldest_seconds(self) -> float:
        """How long the oldest held record has waited (0 if none)."""
        return max((time.monotonic() - held.since for held in self.records), default=0.0)

    def describe(self) -> str:
        """What the next one waits for, in full; those behind it, which wait for the same and more, counted: one
        line stays short however many are held."""
        now = time.monotonic()
        held = sorted(self.records, key=lambda held: (held.message.step, held.record.partition, held.record.offset))
        first = held[0]
        said = (
            f"{self.service.input_topic}[{first.record.partition}] for {now - first.since:.0f} s: "
            f"{self.service.waiting_for(first.message) or 'holding a message'}"
        )
        if len(held) > 1:
            steps = sorted({h.message.step for h in held[1:]})
            said += f" ({len(held) - 1} more held behind it, of steps {steps[0]}..{steps[-1]})"
        return said
