"""The service contract: what every role implements, and what a runner calls, in what order.

A service is the thin adapter around a core in ``common/``: it decodes nothing and touches no bus itself (its
:class:`~services.runtime.ServiceRunner` does both); it turns one input message into output messages.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from common.schema import Message, WeightAnnouncement
from common.weights import WeightIntegrityError
from services.roles import ROLES, Role

if TYPE_CHECKING:
    from common.config import RunConfig

log = logging.getLogger(__name__)

__all__ = [
    "Channel",
    "Collected",
    "Dropped",
    "InputError",
    "ProcessGroup",
    "Progress",
    "Service",
    "check_token_ids",
    "load_announced_weights",
]


class InputError(ValueError):
    """A message that decoded but cannot be processed (e.g. token ids outside the model's vocabulary).

    Raised by :meth:`Service.process`; the runner sends the record to the dead-letter topic."""


class Dropped(Exception):
    """A valid message the service decided not to use (e.g. experience too stale to train on), with the reason.

    Raised by :meth:`Service.process` after the service recorded the decision in its own state; the runner commits
    past the record like a processed one and counts it under the outcome ``dropped``."""


@dataclass
class Progress:
    """What a service's durable state covers: the input it has consumed and the batches it has handled."""

    offsets: dict[str, int] = field(default_factory=dict)
    """``"topic/partition"`` → the next offset to read."""
    handled: list[str] = field(default_factory=list)
    """The batch ids handled last (oldest first, at most ``pipeline.dedupe_window``)."""
    log: str | None = None
    """The identity of the log the offsets were read from (:data:`services.roles.LOG_TOPIC`): they mean nothing on
    another (a broker that lost its data), where the batch ids and steps say what was applied."""


@dataclass
class Collected:
    """Outputs a streaming service has ready (:meth:`Service.collect`): from its input ``batch_id``; ``done``: the
    last of that input's outputs (it may then be committed)."""

    batch_id: str
    outputs: list[Message]
    done: bool


class Channel(ABC):
    """A request/reply exchange a service holds beside its input and output (the generator's model turns to the
    environment replicas, and their answers), given to it by its runner (:meth:`Service.connect`). Nothing on it is
    committed: a reply that never comes is the service's to time out, and a request is sent again only by it. A
    channel whose requests and replies are one topic is a log the service's replicas share (the gateway's episodes):
    each replica reads all of it, its own records included."""

    @abstractmethod
    def send(self, message: Message) -> None:
        """Send a request (signed as the run's messages are); raises while the broker is away."""

    @abstractmethod
    def receive(self) -> list[Message]:
        """The replies that came since the last call, decoded and checked (what is not valid is dead-lettered)."""

    @abstractmethod
    def caught_up(self) -> bool:
        """Whether every reply written before this call has been received: False until a read from the broker that
        began after it found nothing more (call again; :meth:`receive` meanwhile)."""

    @abstractmethod
    def dead_letter(self, message: Message, error: str) -> None:
        """Set ``message`` (made by the service, never sent) aside on the requests topic's dead-letter topic, with
        why."""


class ProcessGroup(ABC):
    """The processes of one replica that spans several (e.g. the ranks of a sharded learner): one leads (runs the
    service's lifecycle and talks to the bus), the others follow it."""

    @abstractmethod
    def launch(self) -> int | None:
        """Called first in every process of the command. In the process a user (or supervisor) started: start the
        group's processes and supervise them until they end, and return the exit code. In a process the launch
        started: None, to go on and serve."""

    @abstractmethod
    def leads(self) -> bool:
        """Whether this process leads the group."""

    @abstractmethod
    def follow(self, service: Service) -> None:
        """In a following process: run what the leader leads, until it is done."""

    def peer_gone(self, exc: BaseException) -> str | None:
        """One line that says which process saw another one go, if that is all ``exc`` says (the failure itself is
        reported where it happened); else None."""
        return None


class Service(ABC):
    """One replica of a role (:data:`services.roles.ROLES`). The lifecycle, as every runner drives it:

    1. ``Service(config, replica_id)``: load models and state. Sets :attr:`config`, :attr:`replica_id` (default
       ``<role>-0``), :attr:`run_id` (messages of other runs are skipped) and :attr:`spec` (the role's entry).
    2. :meth:`start` once, before any input: the messages it returns are produced first (the learner re-announces
       resumed weights, the feeder publishes the prompt batches).
    3. The loop, one step at a time:
       - :meth:`on_weights` for the newest announcement of each of :attr:`weight_models`;
       - :meth:`ready_for` for an input message; False keeps it aside (uncommitted; reading goes on past it) and
         :meth:`waiting_for` says why;
       - :meth:`process`: one input message to the output messages (or :class:`InputError`: dead-lettered, or
         :class:`Dropped`: not used, counted);
       - :meth:`make_durable` before its input is committed: False keeps the input uncommitted (re-delivered
         after a crash) until the service's state is safe. What that state covers (:class:`Progress`: the input
         positions, the batch ids handled) is the runner's to give; a service that restores state gives it back
         with :meth:`restored`.
       - :meth:`done` after each step: True ends the loop;
       - :meth:`tick` when there was nothing to do.
    4. :meth:`finish` once, only if :meth:`done` became True (the run is complete): final exports.
    5. :meth:`close` always, last (also after a signal or an error): release engines and files.

    When the run's log is lost (the broker lost its data), :meth:`take_up_new_log` drops the work in flight and the
    lifecycle starts again at 2 on the new log, with the models kept.

    Before any replica of the run starts, :meth:`check_inputs` (a class method) is asked of every role the run has
    (``streamppo up``, ``run``): what the role would find wrong at its start (a file it reads, a model folder, a
    library), found once, with the loaders it uses then.

    A service that :attr:`streams` works on several inputs at once, and its outputs go on as they are ready: instead
    of :meth:`process`, the runner calls :meth:`admit` for each input while the service has :meth:`room`, and
    :meth:`collect` for what is ready (:meth:`under_way` says whether more is coming without input); an input is
    committed once its last outputs are out (below the oldest input not done, as for one kept aside). A streaming
    service's state must be durable without its help (the generator's is: an input not done comes again, and what it
    already sent is recognised downstream by its keys).

    A replica may span several processes (:meth:`process_group`, e.g. the ranks of a sharded learner). Its leading
    process alone runs the lifecycle above and talks to the bus; the others follow it (:meth:`ProcessGroup.follow`,
    then :meth:`close`).

    Observers registered with :meth:`observe` receive the statistics a service reports as it works (the learner
    reports one record per update), e.g. for Prometheus gauges or a progress bar.
    """

    role: ClassVar[str]  # the key of this service's entry in ROLES

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        self.config = config
        self.spec: Role = ROLES[self.role]
        self.replica_id = replica_id or f"{self.role}-0"
        self.run_id = config.run.run_id
        self._observers: list[Callable[[dict], None]] = []

    @property
    def input_topic(self) -> str | None:
        return self.spec.topics(self.config)[0]

    @property
    def output_topic(self) -> str | None:
        return self.spec.topics(self.config)[1]

    @property
    def weight_models(self) -> tuple[str, ...]:
        return self.spec.weight_models

    # ------------------------------------------------------------------ lifecycle hooks

    def start(self) -> list[Message]:
        """Messages for :attr:`output_topic` to produce once, before any input is handled."""
        return []

    def on_weights(self, announcement: WeightAnnouncement) -> bool:
        """Load a newer snapshot of one of :attr:`weight_models`; False if it was refused (old weights kept)."""
        return False

    def ready_for(self, message: Message) -> bool:
        """False holds ``message`` back (uncommitted) until, e.g., newer weights arrive."""
        return True

    def waiting_for(self, message: Message) -> str:
        """Why :meth:`ready_for` is False, for logs and stall reports."""
        return ""

    @abstractmethod
    def process(self, message: Message) -> list[Message]:
        """The core call: one input message to zero or more messages for :attr:`output_topic`."""

    # ------------------------------------------------------------------ streaming (optional)

    @property
    def streams(self) -> bool:
        """Whether this service works on several inputs at once (:meth:`admit`, :meth:`collect`)."""
        return False

    def room(self) -> int:
        """Inputs a streaming service can take now."""
        return 0

    def admit(self, message: Message) -> None:
        """Start work on ``message`` (a streaming service); raises :class:`InputError` for one it cannot process."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def collect(self) -> list[Collected]:
        """The outputs ready now (a streaming service may do a bounded piece of work to make some)."""
        return []

    def under_way(self) -> bool:
        """Whether a streaming service has work going on that will bring outputs without more input (responses
        being sampled): a round in which it sent nothing is then no stall."""
        return False

    def in_hand(self) -> str:
        """What a streaming service's inputs in flight wait for, when they wait (for status, and the line the runner
        logs): '' when nothing in hand waits. A service that holds work and makes no progress says why here."""
        return ""

    # ------------------------------------------------------------------ a request/reply exchange (optional)

    def channels(self) -> dict[str, tuple[str, str]]:
        """``{name: (requests, replies)}``: the topics of each :class:`Channel` the service needs (none by default).
        The runner then calls :meth:`connect` before the first input."""
        return {}

    def connect(self, channels: dict[str, Channel]) -> None:
        """Take the channels :meth:`channels` asked for, by name."""

    def tick(self) -> list[Message]:
        """Called when the runner found nothing to do: outputs of work a service takes up on time alone (a learner
        that stops waiting for a group in flight). Its state is made durable, and the outputs sent, as for
        :meth:`process`."""
        return []

    def make_durable(self, progress: Progress, force: bool = False) -> bool:
        """Whether the state covering all input handled so far survives a crash; input is committed only then.

        ``progress`` is what that state covers, for a checkpoint to record and :meth:`restored` to give back. A
        service whose state lives in memory (the learner between two checkpoints) returns False until its
        checkpoint is due, or ``force``; its input stays uncommitted meanwhile, so after a crash the broker delivers
        it again to the state restored from the last checkpoint.
        """
        return True

    def restored(self) -> Progress | None:
        """The progress the state this service restored at construction covers (None: it restored nothing). The
        runner takes its memory of handled batch ids from it, so that a batch applied before a crash but not yet
        committed is recognised when it comes back."""
        return None

    def counters(self) -> dict[str, int]:
        """What the service counts beyond the runner's outcomes (the gateway's calls and episodes), for the status
        line and the status topic."""
        return {}

    @property
    def url(self) -> str:
        """Where this replica serves clients over HTTP ('' if nowhere): `streamppo status` shows it."""
        return ""

    def done(self) -> bool:
        """Whether this replica has finished its part of the run; most services serve until stopped."""
        return False

    def finish(self) -> None:
        """Called once when :meth:`done` became True: write what a completed run leaves behind."""

    def shortfall(self) -> str | None:
        """Once :meth:`done`: why the service finished without all the run asked of it, naming the setting that
        applies (the learner's run that used up its prompt batches before ``run.steps``); None when it did it all."""
        return None

    def close(self) -> None:
        """Release what the service holds outside this process (e.g. an inference engine)."""

    def take_up_new_log(self) -> bool:
        """The run's log is gone (the broker lost its data, :class:`~services.transport.LogReplaced`) and a runner on
        the new log follows: drop the work in flight on the old one, keep what is loaded (models, weights), and go
        on as a replica started in resume mode would (:meth:`start` is called again). The state :meth:`make_durable`
        covers was made durable first. False: this service cannot; its process exits (``exit_codes.LOG_REPLACED``)
        to be started again in resume mode."""
        return False

    # ------------------------------------------------------------------ before a run

    @classmethod
    def check_inputs(cls, config: RunConfig) -> None:
        """Raise what a replica of this role would raise at its start for ``config``'s inputs (a
        :class:`~common.config.ConfigError`, or a loader's ``DatasetError``, ``RewardError``, ``ModelLoadError``
        naming the setting), with the loaders it uses; builtin models are built into the cache now, once."""

    # ------------------------------------------------------------------ replicas of several processes

    @classmethod
    def process_group(cls, config: RunConfig) -> ProcessGroup | None:
        """How one replica of this role spans several processes on its machine; None: it runs as one."""
        return None

    # ------------------------------------------------------------------ observers

    def observe(self, callback: Callable[[dict], None]) -> None:
        """Call ``callback(statistics)`` for each record this service reports."""
        self._observers.append(callback)

    def report(self, statistics: dict) -> None:
        for callback in self._observers:
            callback(statistics)


def check_token_ids(message: Message, model, role: str) -> None:
    """Reject token ids the model's embedding cannot look up (the schema only knows they are non-negative).

    ``model`` may be a meta-device skeleton: only its embedding's size is read.
    """
    vocab = model.get_input_embeddings().num_embeddings
    for name in ("prompt_tokens", "response_tokens"):
        array = getattr(message, name, None)
        if array is not None and array.size and int(array.max()) >= vocab:
            raise InputError(f"{name} holds id {int(array.max())}, outside the {role}'s vocabulary of {vocab}")


def load_announced_weights(load, announcement: WeightAnnouncement, replica_id: str, current_version: int) -> bool:
    """Load an announced snapshot with ``load(chain)``; a damaged one is refused and the current weights kept.

    ``load`` raises :class:`WeightIntegrityError` for a snapshot it refuses (a sampler's ``load_snapshot``, or
    :func:`common.weights.load_snapshot_into` bound to a module).
    """
    try:
        load(announcement.chain)
    except WeightIntegrityError as exc:
        log.error("%s: keeping %s v%d: %s", replica_id, announcement.model, current_version, exc)
        return False
    log.info("%s: %s weights v%d loaded", replica_id, announcement.model, announcement.policy_version)
    return True
