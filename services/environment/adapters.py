"""Environments of the ecosystem's standards, served through streamppo's contract.

OpenEnv (``openenv-core``, Meta and Hugging Face; what TRL trains against) defines an environment as a class with
``reset(seed, episode_id, **kwargs) -> Observation`` and ``step(action) -> Observation``, where an observation is a
pydantic model with ``done`` and ``reward`` and an action is a pydantic model the environment defines. That is a
gym-like contract like ours, run in process: the adapter makes the OpenEnv environment inside each episode's
:class:`OpenEnvEnvironment`, with no server, container or network. What it adds is the mapping between text and
those models, which OpenEnv leaves to the trainer:

- **action**: the model's turn becomes the environment's action type with the turn's text in one string field
  (``environment.openenv.action_field``; by default the type's only string field), or whatever a function named by
  ``action_parser`` makes of it (for actions that are more than text, such as OpenEnv's MCP ``CallToolAction``);
- **observation**: the observation's text field (``observation_field``; by default its one field besides ``done``,
  ``reward`` and ``metadata`` where that is a string, else those fields as JSON), set in ``observation_format``;
- **reset**: ``seed`` is derived from the prompt and label, and ``prompt`` and ``label`` are passed where the
  environment's ``reset`` takes them, so an episode replayed on another replica meets the same environment, and the
  ``n`` episodes of one prompt the same task. What ``reset`` returns is not shown to the model: the dataset row's
  prompt is what it reads first.

Why OpenEnv and not ``verifiers``: verifiers 0.4 environments own the rollout loop, calling the model through an
OpenAI-compatible client (chat messages in and out, re-tokenised), where here the generator owns the tokens and the
environment answers turns; OpenEnv's reset/step is that shape already. ``openenv-core`` 0.3.0 installs beside the
pinned vLLM (``pip install 'streamppo[openenv]'``); ``openenv`` 0.10 does not (its fastmcp < 4 needs mcp < 2, vLLM
needs mcp 2).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import typing
from collections.abc import Callable
from functools import cache
from typing import Any

from common.config import EnvironmentSection, OpenEnvSection
from common.named import load_named
from services.environment.base import Environment, Step

__all__ = ["OpenEnvEnvironment", "openenv_seed"]

STANDARD_FIELDS = ("done", "reward", "metadata")


def openenv_seed(prompt: str, label: str) -> int:
    """The seed an episode's environment is reset with: a function of the row alone (replicas agree on it)."""
    return int.from_bytes(hashlib.sha256(f"{prompt}\0{label}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def _named(path: str, what: str) -> Any:
    return load_named(path, f"environment.openenv.{what}")  # a NamedError (a ValueError) says what was tried


def _string_fields(model: type, exclude: tuple[str, ...] = ()) -> list[str]:
    return [
        name
        for name, field in model.model_fields.items()
        if name not in exclude and field.annotation in (str, str | None)
    ]


class _Resolved(typing.NamedTuple):
    environment: type
    make_action: Callable[[str], Any]
    reset_takes: frozenset[str]


def _resolve(section: OpenEnvSection) -> _Resolved:
    """The environment class and how a turn becomes its action, checked once per config (a wrong one fails at the
    generator's or the replica's start, naming the setting)."""
    return _resolve_names(section.environment, section.action, section.action_field, section.action_parser)


@cache
def _resolve_names(environment_name: str, action_name: str | None, field: str | None, parser: str | None) -> _Resolved:
    try:
        from openenv.core.env_server.interfaces import Environment as OpenEnv
        from openenv.core.env_server.types import Action
    except ImportError as exc:
        raise ValueError(f"environment.openenv needs OpenEnv: make venv EXTRAS=openenv (openenv-core) ({exc})") from exc
    environment = _named(environment_name, "environment")
    if not (isinstance(environment, type) and issubclass(environment, OpenEnv)):
        raise ValueError(
            f"environment.openenv.environment {environment_name!r} is not an OpenEnv environment (a subclass of "
            "openenv.core.env_server.interfaces.Environment)"
        )
    parameters = inspect.signature(environment.reset).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    reset_takes = frozenset(name for name in ("seed", "prompt", "label") if takes_any or name in parameters)
    if parser is not None:
        return _Resolved(environment, _named(parser, "action_parser"), reset_takes)
    action = _named(action_name, "action") if action_name else _action_type(environment)
    if not (isinstance(action, type) and issubclass(action, Action)):
        raise ValueError(
            f"environment.openenv: {environment.__qualname__}'s action type is not known (found {action!r}); set "
            "environment.openenv.action ('module:Class', an openenv Action) or action_parser"
        )
    if field is None:
        candidates = _string_fields(action, exclude=STANDARD_FIELDS)
        if len(candidates) != 1:
            raise ValueError(
                f"environment.openenv: {action.__qualname__} has {len(candidates)} string fields ({candidates}), so "
                "which one the model's turn fills is not clear: set environment.openenv.action_field, or "
                "action_parser"
            )
        (field,) = candidates
    elif field not in action.model_fields:
        raise ValueError(
            f"environment.openenv.action_field {field!r}: {action.__qualname__} has no such field "
            f"({sorted(action.model_fields)})"
        )
    return _Resolved(environment, lambda text: action(**{field: text}), reset_takes)


def _action_type(environment: type) -> Any:
    """The action class an OpenEnv environment declares: its ``step``'s annotation, else its generic argument
    (``Environment[MyAction, MyObservation, MyState]``)."""
    try:
        hinted = typing.get_type_hints(environment.step).get("action")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve is no declaration
        hinted = None
    if isinstance(hinted, type):
        return hinted
    for klass in environment.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            arguments = typing.get_args(base)
            if arguments and isinstance(arguments[0], type):
                return arguments[0]
    return hinted


class OpenEnvEnvironment(Environment):
    """An OpenEnv environment (``environment.openenv``) as a streamppo environment; one instance per episode."""

    def __init__(self, config: EnvironmentSection):
        super().__init__(config)
        if config.openenv is None:
            raise ValueError(f"{type(self).__qualname__} reads environment.openenv, which is not set")
        self.section = config.openenv
        resolved = _resolve(self.section)
        self.make_action, self.reset_takes = resolved.make_action, resolved.reset_takes
        self.environment = resolved.environment(**self.section.kwargs)
        self.stop = self.stops(config)

    @classmethod
    def stops(cls, config: EnvironmentSection) -> tuple[str, ...]:
        if config.openenv is None:
            raise ValueError(f"{cls.__qualname__} reads environment.openenv, which is not set")
        _resolve(config.openenv)
        return tuple(config.openenv.stop)

    def reset(self, prompt: str, label: str) -> None:
        given = {"seed": openenv_seed(prompt, label), "prompt": prompt, "label": label}
        self.environment.reset(**{name: value for name, value in given.items() if name in self.reset_takes})

    def step(self, turn: str) -> Step:
        observation = self.environment.step(self.make_action(turn))
        reward = observation.reward
        return Step(
            observation=self.section.observation_format.format(observation=self._text(observation)),
            reward=0.0 if reward is None else float(reward),
            done=bool(observation.done),
            info={"openenv": type(self.environment).__qualname__},
        )

    def _text(self, observation: Any) -> str:
        field = self.section.observation_field
        if field is not None:
            if field not in type(observation).model_fields:
                raise ValueError(
                    f"environment.openenv.observation_field {field!r}: {type(observation).__qualname__} has no such "
                    f"field ({sorted(type(observation).model_fields)})"
                )
            return str(getattr(observation, field))
        rest = observation.model_dump(mode="json", exclude=set(STANDARD_FIELDS))
        if len(rest) == 1 and _string_fields(type(observation), exclude=STANDARD_FIELDS):
            return next(iter(rest.values())) or ""
        return json.dumps(rest, sort_keys=True) if rest else ""

    def close(self) -> None:
        self.environment.close()
