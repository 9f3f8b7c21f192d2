"""A streaming service's inputs in flight (``Service.streams``: a generator's engine samples several prompt batches
at once, a gateway's calls wait for their answers).

Each input is given to the service as it comes (:meth:`Streaming.admit`), its outputs are sent as the service has
them ready (:meth:`Streaming.collect`), and it is committed once its last outputs are out: never past the oldest
input in flight, which comes again after a restart.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import TYPE_CHECKING

from common.schema import BatchMessage
from services.runtime.held import Held
from services.runtime.sending import OutputError
from services.service import Collected, InputError
from services.transport import Record

if TYPE_CHECKING:
    from services.runtime.runner import ServiceRunner

__all__ = ["Streaming"]


class Streaming:
    """The inputs one runner's streaming service has in hand, and its outputs not yet sent."""

    def __init__(self, runner: ServiceRunner):
        self.runner, self.service = runner, runner.service
        self.in_flight: dict[str, Held] = {}  # inputs not done, by batch id
        self.uncollected: list[Collected] = []  # outputs not yet sent
        self.tokens: Counter[str] = Counter()  # response tokens sent so far per input in flight

    def admit(self, record: Record, message: BatchMessage) -> None:
        """Give the service one more input; it stays uncommitted until its last outputs are out."""
        runner = self.runner
        runner.last_progress = time.monotonic()
        if message.batch_id in self.in_flight:  # delivered again while its first delivery is in hand
            runner.count("duplicate")
            runner.offsets.commit(record)  # never past the first delivery, which is in flight
            return
        try:
            with runner.timed("compute"), runner.uninterrupted():
                self.service.admit(message)
        except InputError as exc:
            runner.intake.set_aside(record, f"cannot process batch {message.batch_id}: {exc}")
            runner.offsets.commit(record)
            return
        self.in_flight[message.batch_id] = Held(record, message, time.monotonic())

    def collect(self) -> bool:
        """Send what the service has ready (first what failed to go out before); an input whose last outputs are
        out is committed. Returns whether anything was sent."""
        runner = self.runner
        if not self.uncollected:
            started = time.perf_counter()
            with runner.timed("compute"), runner.uninterrupted():
                self.uncollected = list(self.service.collect())
            outputs = [output for item in self.uncollected for output in item.outputs]
            for output in outputs:  # this stage's compute, as a batch's is recorded: the call's, shared out
                output.lineage[f"seconds.{self.service.role}"] = round(
                    (time.perf_counter() - started) / len(outputs), 4
                )
        did = bool(self.uncollected)
        while self.uncollected:
            item = self.uncollected[0]
            try:
                with runner.timed("produce"):
                    runner.sender.send(item.outputs)  # raises while the broker is away: sent again at the next poll
            except OutputError as exc:
                runner.intake.set_aside(self.in_flight[item.batch_id].record, f"batch {item.batch_id}: {exc}")
                item = dataclasses.replace(item, outputs=[])
            self.uncollected.pop(0)
            runner.last_progress = time.monotonic()
            runner.counters["produced"] += len(item.outputs)
            self.tokens[item.batch_id] += sum(o.response_tokens_total for o in item.outputs)
            if item.done:
                self._finish(item.batch_id)
        return did

    def _finish(self, batch_id: str) -> None:
        runner = self.runner
        held = self.in_flight.pop(batch_id)
        for key in held.message.idempotency_keys():
            runner.recent.add(key)
        tokens = self.tokens.pop(batch_id, 0)
        runner.count("processed", held.message.rows, time.monotonic() - held.since, tokens)
        runner.offsets.commit(held.record)
        runner.metrics.lag.labels(self.service.role).set(runner.work.lag())
