"""What a sampler takes and returns, shared by the generator's samplers (``services/generator/samplers.py``) and the
learner's evaluation (``common.generation``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Sampler", "SamplingParams", "Samples"]


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0

    def lineage(self) -> dict:
        return {f"sampling.{k}": v for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Samples:
    """``N = B·n`` responses; row ``i`` answers prompt row ``group_index[i]``."""

    group_index: torch.Tensor  # (N,) long
    response_tokens: torch.Tensor  # (N, T) long, right-padded
    response_lengths: torch.Tensor  # (N,) long; a finished response's last token is its EOS
    finished: torch.Tensor  # (N,) bool: ended with EOS
    behaviour_logprobs: torch.Tensor  # (N, T) float32, 0 at padding
    token_versions: torch.Tensor | None = None  # (N, T) int32, 0 at padding; None: all by the weights loaded


class Sampler(Protocol):
    backend: str
    skeleton: torch.nn.Module  # the actor's module tree, for name/shape/vocabulary checks (may be on meta)

    def sample(self, prompt_tokens: torch.Tensor, prompt_lengths: torch.Tensor, params: SamplingParams) -> Samples:
        """``params.n`` responses for each of the ``B`` right-padded prompts ``(B, P)`` with lengths ``(B,)``."""

    def load_snapshot(self, chain: list[str]) -> None:
        """Load actor weights in place; raises ``WeightIntegrityError`` (old weights kept) for a bad snapshot."""

    def join_broadcast(self, address: str, timeout_s: float, algorithm: str, name: str) -> None:
        """Receive the learner's broadcasts (``common.broadcast``) from now on, where the weights live."""

    def load_broadcast(self, version: int, digest: str, chain: list[str]) -> bool:
        """Load ``version`` from the broadcast if exactly ``digest`` was received (``chain``: the same version in the
        store); False otherwise, weights untouched. Raises ``WeightIntegrityError`` for tensors that do not fit."""

    def close(self) -> None: ...
