"""The environment contract: what a multi-turn episode talks to between the model's turns.

An environment is a Python class named in the config (``environment.name: "module:Class"``), gym-like:

- ``reset(prompt, label)`` at the start of an episode (the dataset row's prompt text and label);
- ``step(turn)`` after each of the model's turns (its text), returning a :class:`Step`: the observation to append
  (text the model reads, never trains on), a reward, and whether the episode is done;
- ``close()`` when the episode is over.

Environment replicas (``streamppo environment``, ``environment.placement: bus``) answer turns from any generator;
a replica that gets a turn of an episode it never saw (another replica died, or the turn was re-delivered) makes the
environment again and replays the episode's earlier turns into it, so an environment's state must follow from its
prompt, label and the model's turns (a stateless one, or one that is deterministic in them). With ``placement:
local`` the generator steps them in threads of its own process.

The generator asks the model for a turn, which ends at the model's EOS or at one of the environment's
:attr:`Environment.stop` strings (a tool call's closing tag), then steps the environment with it. The observation
is tokenized alone and appended to the episode's tokens: the conversation is never re-tokenised. An episode's reward
from its environment (the sum of its steps') travels with it to the scorer (``environment_reward``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from common.config import EnvironmentSection
from common.named import load_named

__all__ = ["Environment", "Step", "load_environment"]


@dataclass(frozen=True)
class Step:
    """What the environment answers to one of the model's turns."""

    observation: str = ""
    """Text appended after the model's turn (a tool's result); read by the model, never trained on."""
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)
    """What happened, for logs and metrics (e.g. ``{"tool": "calculator", "status": "ok"}``)."""


class Environment(ABC):
    """One episode's environment. A new instance is made for each episode, from the config's section."""

    stop: ClassVar[tuple[str, ...]] = ()
    """Strings that end a model turn besides EOS (a tool call's closing tag); kept in the turn's text."""

    def __init__(self, config: EnvironmentSection):
        self.config = config

    @classmethod
    def stops(cls, config: EnvironmentSection) -> tuple[str, ...]:
        """The strings that end a model turn under ``config`` (the generator reads them without an environment)."""
        return tuple(cls.stop)

    @abstractmethod
    def reset(self, prompt: str, label: str) -> None:
        """Start an episode for a dataset row."""

    @abstractmethod
    def step(self, turn: str) -> Step:
        """The model's turn (its text, a stop string included) to what it gets back."""

    def close(self) -> None:
        """Release what the episode held (the default holds nothing)."""


def load_environment(config: EnvironmentSection) -> type[Environment]:
    """The class ``config.name`` names (``"module:Class"``), checked to be an :class:`Environment`."""
    cls = load_named(config.name, "environment.name")  # a NamedError (a ValueError) says what was tried
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment.name {config.name!r} is not a subclass of {Environment.__qualname__}")
    return cls
