"""environment: turns → observations. Answers the model's turns of multi-turn episodes with the configured
environment (``environment.name``), one environment per episode.

A replica keeps the environments of the episodes it answered last. A turn of an episode it does not hold (the
episode began on a replica that died, or this one forgot it) makes the environment again: ``reset`` with the
prompt and label, then a ``step`` with each earlier model turn, whose answers are not sent. An environment that
raises ends its episode, with the error as the reply's status: no input stops the replica.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from common.config import RunConfig
from common.schema import EnvironmentReply, EpisodeTurn, new_header
from services.environment.base import Environment, Step, load_environment
from services.service import Service

log = logging.getLogger(__name__)

__all__ = ["EnvironmentService"]

KEEP_EPISODES = 4096  # environments held for episodes in flight; the least recently used goes first


@dataclass
class _Held:
    environment: Environment
    turns: int  # model turns it has stepped on


class EnvironmentService(Service):
    role = "environment"

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        super().__init__(config, replica_id)
        if config.environment is None:
            raise ValueError("the environment role needs an environment section (environment.name, ...)")
        self.environment_class = load_environment(config.environment)
        self.held: OrderedDict[tuple[str, str], _Held] = OrderedDict()

    def process(self, message: EpisodeTurn) -> list[EnvironmentReply]:
        key = (message.reply_to, message.episode)
        held = self.held.pop(key, None)
        try:
            if held is None or held.turns != message.turn:
                if held is not None:
                    held.environment.close()
                held = self._rebuild(message)
            step = held.environment.step(message.model_turns[-1])
            held.turns += 1
            status = "ok"
        except Exception as exc:  # the episode ends; the replica goes on
            log.warning("%s: episode %s: the environment failed: %r", self.replica_id, message.episode, exc)
            step, status = Step(done=True), f"error: {type(exc).__name__}: {exc}".splitlines()[0][:500]
            held = None
        if held is not None and not step.done:
            self.held[key] = held
            while len(self.held) > KEEP_EPISODES:
                self.held.popitem(last=False)[1].environment.close()
        elif held is not None:
            held.environment.close()
        reply = EnvironmentReply(
            **new_header(message.batch_id, self.replica_id, message.policy_version, message.lineage),
            step=message.step,
            episode=message.episode,
            turn=message.turn,
            reply_to=message.reply_to,
            observation=step.observation,
            reward=float(step.reward),
            done=bool(step.done),
            status=status,
        )
        return [reply]

    def _rebuild(self, message: EpisodeTurn) -> _Held:
        """The episode's environment as it was before this turn: made, reset, and stepped with the earlier turns."""
        environment = self.environment_class(self.config.environment)
        environment.reset(message.prompt_text, message.prompt_label)
        for earlier in message.model_turns[:-1]:
            environment.step(earlier)
        if message.turn:
            log.info(
                "%s: episode %s taken up at turn %d (earlier turns replayed)",
                self.replica_id,
                message.episode,
                message.turn,
            )
        return _Held(environment, message.turn)

    def close(self) -> None:
        for held in self.held.values():
            held.environment.close()
        self.held.clear()
