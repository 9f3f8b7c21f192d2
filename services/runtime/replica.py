"""A replica's life, written once: every host (a process of its own, the embedded run's turns, a fleet's runs) drives
it through the same three calls, and none of them repeats what happens inside.

``start()``
    The runner on the bus: the log joined (its identity made if the topics have none), the role's consumer group, the
    weights feed; the service's channels connected; then what the service's ``start()`` returns is produced (the
    feeder's prompt batches, a resumed learner's announcement), before any input is read.

``step(timeout_s)``
    One poll: weights first, then at most one input (or a streaming service's round). When the broker lost the log
    (:class:`~services.transport.LogReplaced`), the replica leaves it here, its state made durable first (a learner
    checkpoints what it applied), and either goes on on the new log with its models (``Service.take_up_new_log``: a
    new runner on a new bus, started again), or, for a service that cannot, ends: ``lost_log`` says why, and its host
    stops it (a process exits 4, to be started again in resume mode).

``stop(finished)``
    The shutdown, always in this order (as faust's ``BootStrategy`` states its own):

    1. **finish**: the service's last work, when it is done and ``finished`` (the learner's final models and report);
    2. **settle**: its state made durable (a learner's checkpoint) and its engines and files released, however long
       the disk takes;
    3. **report**: its last status, ``done`` or ``stopped``, on the status topic;
    4. **disconnect**: its input committed as far as the durable state covers, its consumer group left.

    Steps 3 and 4 need the broker; a host may bound them (``broker_within``: a process exits when the broker does not
    answer in time, its input then delivered again). Steps 1 and 2 need none and are never cut short.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from services.runtime.metrics import ServiceMetrics
from services.runtime.runner import ServiceRunner
from services.service import Service
from services.transport import Bus, LogReplaced

log = logging.getLogger(__name__)

__all__ = ["Replica"]


class Replica:
    """One service's replica on a bus. ``bus_of()`` gives the bus to start on, and a new one after a lost log (the
    log that took its place: the first service there makes its topics)."""

    def __init__(self, service: Service, bus_of: Callable[[], Bus], metrics: ServiceMetrics | None = None):
        self.service, self.bus_of = service, bus_of
        self.metrics = metrics or ServiceMetrics(service.role)
        self.runner: ServiceRunner | None = None
        self.lost_log: str | None = None  # why it ended on a lost log it could not go on from (None: it did not)
        self.closed = False  # the service closed (once: its engines and shared models are released once)
        self.shortfall: str | None = None  # why it finished short of what the run asked (Service.shortfall)

    @property
    def replica_id(self) -> str:
        return self.service.replica_id

    def start(self) -> Replica:
        """Build the runner and start the service (see the module's docstring); returns the replica."""
        try:
            self.runner = ServiceRunner(self.service, self.bus_of(), metrics=self.metrics)
            self.runner.start()
        except BaseException:
            if self.runner is None:
                self._close_service()  # no runner will settle it
            raise
        return self

    def _close_service(self) -> None:
        if not self.closed:
            self.closed = True
            self.service.close()

    @property
    def ended(self) -> bool:
        """Whether it ended on a lost log (a host stops it then)."""
        return self.lost_log is not None

    def step(self, timeout_s: float = 0.0, go_on: bool = True) -> bool:
        """One poll of the runner; whether anything was done. A lost log is left here (see the module's docstring);
        ``go_on`` False (a stop was asked for) ends the replica there instead of going on."""
        try:
            return self.runner.poll_once(timeout_s)
        except LogReplaced as exc:
            going_on = self.runner.leave_for_new_log(exc, go_on=go_on)  # a learner checkpoints first
            self.runner = None
            if not going_on:
                self.lost_log = str(exc)
                return False
            self.start()
            return True

    def stop(
        self,
        finished: bool = True,
        report: Callable[[ServiceRunner, str], None] | None = None,
        broker_within: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        """Finish, settle, report, disconnect (see the module's docstring). ``finished``: whether this stop ends the
        service's work (not a signal, an error or a lost log); ``report(runner, state)``: the last status report
        (by default the runner's own, on the status topic); ``broker_within()``: what bounds the broker's part."""
        done = self.service.done()
        try:
            if finished and done and self.lost_log is None:
                self.service.finish()
                self.shortfall = self.service.shortfall()
        finally:
            if self.runner is None:
                self._close_service()  # a replica that never started, or one whose lost log it left
            elif not self.closed:
                self.closed = True  # settle closes the service
                self.runner.settle()
                with broker_within():
                    (report or _publish_status)(self.runner, "done" if done else "stopped")
                    self.runner.disconnect()


def _publish_status(runner: ServiceRunner, state: str) -> None:
    try:
        runner.publish_status(state)
    except Exception as exc:  # the last report is not worth failing a stop over
        log.warning("%s: last status not published (%s)", runner.replica_id, exc)
