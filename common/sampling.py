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
    seed: int | None = 0  # None: unseeded, the engine's own randomness (a gateway's calls: a retry is never resampled)
    stop: tuple[str, ...] = ()  # strings that end a response besides EOS (kept in it): an episode's tool calls

    def lineage(self) -> dict:
        return {f"sampling.{k}": v for k, v in self.__dict__.items() if k != "stop"} | (
            {"sampling.stop": "\x1f".join(self.stop)} if self.stop else {}
        )


@dataclass(frozen=True)
class Samples:
    """``N = B·n`` responses; row ``i`` answers prompt row ``group_index[i]``."""

    group_index: torch.Tensor  # (N,) long
    response_tokens: torch.Tensor  # (N, T) long, right-padded
    response_lengths: torch.Tensor  # (N,) long; a finished response's last token is its EOS
    finished: torch.Tensor  # (N,) bool: ended with EOS
    behaviour_logprobs: torch.Tensor  # (N, T) float32, 0 at padding
    token_versions: torch.Tensor | None = None  # (N, T) int32, 0 at padding; None: all by the weights loaded
    # (N, T) bool, True at the tokens the model sampled; None: every real token (a single answer). An episode's
    # environment tokens are False: context for the model, never trained.
    model_mask: torch.Tensor | None = None
    turns: torch.Tensor | None = None  # (N,) long, the model's turns in each response; None: 1 each
    environment_reward: torch.Tensor | None = None  # (N,) float32, an episode's rewards from its environment; None: 0

    def real(self) -> torch.Tensor:
        """``(N, T)`` bool: the real tokens of each response (the model's and an environment's)."""
        return torch.arange(self.response_tokens.shape[1]) < self.response_lengths.unsqueeze(-1)

    def models(self) -> torch.Tensor:
        """``(N, T)`` bool: the tokens the model sampled."""
        return self.model_mask if self.model_mask is not None else self.real()

    def turn_counts(self) -> torch.Tensor:
        """``(N,)`` long: the model's turns in each response."""
        return self.turns if self.turns is not None else torch.ones(len(self.response_lengths), dtype=torch.long)

    def environment_rewards(self) -> torch.Tensor:
        """``(N,)`` float32: what each episode's environment returned as reward, summed (0 for a single answer)."""
        if self.environment_reward is not None:
            return self.environment_reward
        return torch.zeros(len(self.response_lengths), dtype=torch.float32)

    def labelled(self, version: int) -> torch.Tensor:
        """``(N, T)`` token versions of responses sampled whole by ``version``: it at each of the model's tokens, 0
        elsewhere."""
        return torch.where(self.models(), version, 0).to(torch.int32)

    @staticmethod
    def concat(parts: list[Samples]) -> Samples:
        """The responses of ``parts`` (each answering its own prompts) as one, prompts numbered on; each part's
        versions as it has them (see :meth:`labelled`), 2-D fields right-padded to the widest."""
        width = max(part.response_tokens.shape[1] for part in parts)

        def cat(tensors: list[torch.Tensor], pad: int | float = 0) -> torch.Tensor:
            return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad) for t in tensors])

        offsets, prompts = [], 0
        for part in parts:
            offsets.append(part.group_index + prompts)
            prompts += int(part.group_index.max()) + 1 if len(part.group_index) else 0
        episodes = any(p.model_mask is not None for p in parts)
        return Samples(
            torch.cat(offsets),
            cat([part.response_tokens for part in parts]),
            torch.cat([part.response_lengths for part in parts]),
            torch.cat([part.finished for part in parts]),
            cat([part.behaviour_logprobs for part in parts]),
            None if any(p.token_versions is None for p in parts) else cat([p.token_versions for p in parts]),
            cat([p.models() for p in parts]) if episodes else None,
            torch.cat([p.turn_counts() for p in parts]) if episodes else None,
            torch.cat([p.environment_rewards() for p in parts]) if episodes else None,
        )


class Sampler(Protocol):
    backend: str
    skeleton: torch.nn.Module  # the actor's module tree, for name/shape/vocabulary checks (may be on meta)
    updates_in_flight: bool  # whether new weights may load while groups are in flight (else: finish them first)

    def sample(self, prompt_tokens: torch.Tensor, prompt_lengths: torch.Tensor, params: SamplingParams) -> Samples:
        """``params.n`` responses for each of the ``B`` right-padded prompts ``(B, P)`` with lengths ``(B,)``."""

    def load_snapshot(self, chain: list[str], version: int | None = None) -> None:
        """Load actor weights in place (``version``: what they are, for the tokens sampled from then on); raises
        ``WeightIntegrityError`` (old weights kept) for a bad snapshot."""

    def submit(self, key: str, prompt: list[int], params: SamplingParams) -> None:
        """Start sampling ``params.n`` responses to ``prompt`` (a group named ``key``) beside those in flight."""

    def step(self, seconds: float) -> list[tuple[str, Samples]]:
        """Sample for about ``seconds`` (at least one step); the groups submitted that finished meanwhile."""

    def in_flight(self) -> int:
        """Groups submitted and not yet returned by :meth:`step`."""

    def abort(self, keys: list[str]) -> None:
        """Stop sampling the groups of ``keys`` (submitted, not yet returned); :meth:`step` never returns them."""

    def join_broadcast(self, address: str, timeout_s: float, algorithm: str, name: str) -> None:
        """Receive the learner's broadcasts (``common.broadcast``) from now on, where the weights live."""

    def load_broadcast(self, version: int, digest: str, chain: list[str]) -> bool:
        """Load ``version`` from the broadcast if exactly ``digest`` was received (``chain``: the same version in the
        store); False otherwise, weights untouched. Raises ``WeightIntegrityError`` for tensors that do not fit."""

    def close(self) -> None: ...
