"""The rewards' common parts: a reward function named ``module:function``, a reward model, and what every reward
shares (its error, the check of its scores, ``close()``).

A reward function takes ``(prompts: list[str], responses: list[str])``, or ``(prompts, responses, labels)`` to be
given each prompt's label from the dataset (``{"prompt": ..., "label": ...}``; ``""`` where a row has none), and
returns one float per response. The rule rewards the examples train on are in :mod:`recipes.rewards`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import torch

from common.named import NamedError, load_named

__all__ = [
    "RewardError",
    "RewardFunction",
    "RewardModelScorer",
    "checked_scores",
    "encode_pairs",
    "load_reward_function",
]

RewardFn = Callable[..., Sequence[float]]


class RewardError(RuntimeError):
    """The reward source could not be loaded, or returned something that is not one finite score per response."""


def load_reward_function(spec: str) -> RewardFn:
    """The function ``spec`` names: ``module:function``, or ``path/to/file.py:function`` (:mod:`common.named`)."""
    try:
        fn = load_named(spec, "reward.function")
    except NamedError as exc:
        raise RewardError(str(exc)) from None
    if not callable(fn):
        raise RewardError(f"reward function {spec!r} is not callable")
    return fn


def checked_scores(scores, count: int, source: str) -> torch.Tensor:
    try:
        values = [float(s) for s in scores]
    except (TypeError, ValueError) as exc:
        raise RewardError(f"{source} returned non-numeric scores: {exc}") from None
    if len(values) != count:
        raise RewardError(f"{source} returned {len(values)} scores for {count} responses")
    if not all(math.isfinite(v) for v in values):
        raise RewardError(f"{source} returned a NaN or infinite score")
    return torch.tensor(values, dtype=torch.float32)


def _takes_labels(fn: RewardFn) -> bool:
    """Whether ``fn`` accepts a third argument; a callable with no signature to read (some builtins) is taken to
    be of the two-argument form."""
    try:
        inspect.signature(fn).bind([], [], [])
    except (TypeError, ValueError):
        return False
    return True


class RewardFunction:
    def __init__(self, spec: str):
        self.spec = spec
        self.fn = load_reward_function(spec)
        self.takes_labels = _takes_labels(self.fn)

    def close(self) -> None:
        """Nothing to release: a function holds no engine or model."""

    def last_call(self) -> dict:
        """What the scored record's lineage says of the last call: nothing, for a function."""
        return {}

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str]) -> torch.Tensor:
        try:
            return self._scores(prompts, responses, labels)
        except Exception as exc:  # the user's code: say which input it failed on, and how
            raise RewardError(f"{self._failure(exc)}{self._failing_row(prompts, responses, labels)}") from exc

    def _scores(self, prompts, responses, labels) -> torch.Tensor:
        texts = (list(prompts), list(responses)) + ((list(labels),) if self.takes_labels else ())
        return checked_scores(self.fn(*texts), len(responses), f"reward function {self.spec}")

    def _failure(self, exc: Exception) -> str:
        if isinstance(exc, RewardError):  # checked_scores' own words (no score per response, not finite)
            return str(exc)
        return f"reward function {self.spec} raised {type(exc).__name__}: {exc}"

    def _failing_row(self, prompts, responses, labels) -> str:
        """The first row the function fails on alone, as text for the error (it may fail on the batch alone)."""
        for i, (prompt, response, label) in enumerate(zip(prompts, responses, labels)):
            try:
                self._scores([prompt], [response], [label])
            except Exception:
                return f"; on row {i}: prompt {prompt[:200]!r}, response {response[:200]!r}, label {label!r}"
        return ""


def encode_pairs(tokenizer, prompts: Sequence[str], responses: Sequence[str], max_length: int):
    """How a reward model reads text, in training and in the scorer alike: (prompt, response) as a text pair,
    truncated longest-first to ``max_length`` tokens."""
    return tokenizer(
        list(prompts),
        list(responses),
        padding=True,
        truncation="longest_first",
        max_length=max_length,
        return_tensors="pt",
    )


class RewardModelScorer:
    """Scores text with a one-label sequence classifier and its own tokenizer.

    The reward model need not share the actor's tokenizer, so it reads the decoded text, encoded as a
    (prompt, response) pair.
    """

    def __init__(
        self,
        model,
        tokenizer,
        batch_size: int = 16,
        max_length: int = 512,
        name: str = "reward model",
        release: Callable[[], None] | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_length, self.name = batch_size, max_length, name
        self.release = release  # called once on close: the model is shared (common.models.FrozenModels)

    def close(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            release()

    def last_call(self) -> dict:
        """What the scored record's lineage says of the last call: nothing, for a reward model."""
        return {}

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str] = ()) -> torch.Tensor:
        """Scores of each (prompt, response); a reward model reads no labels."""
        scores = []
        for start in range(0, len(responses), self.batch_size):
            chunk = slice(start, start + self.batch_size)
            enc = encode_pairs(self.tokenizer, prompts[chunk], responses[chunk], self.max_length)
            scores.append(self.model(**enc.to(self.model.device)).logits[:, 0].float().cpu())
        return checked_scores(torch.cat(scores).tolist() if scores else [], len(responses), self.name)
