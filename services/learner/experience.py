"""Experience as the learner trains on it: tensors of N sequences, decoded from experience records."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from common import ppo
from common.schema import ExperienceBatch
from common.sequences import PackedSequences, lengths_to_mask

__all__ = ["Experience", "PreparedBatch", "experience_statistics"]


@dataclass(frozen=True)
class Experience:
    """Experience as tensors: ``N`` sequences, prompts ``(N, P)``, responses ``(N, T)``. An update's experience may
    gather groups sampled by several policy versions."""

    policy_versions: torch.Tensor  # (N,) the oldest actor version that sampled a token of each sequence
    prompt_tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_tokens: torch.Tensor
    response_lengths: torch.Tensor
    finished: torch.Tensor
    behaviour_logprobs: torch.Tensor
    scores: torch.Tensor
    kl: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    ref_logprobs: torch.Tensor | None = None  # (N, T), for the KL term of the loss (algorithm.kl_in: loss)
    token_versions: torch.Tensor | None = None  # (N, T) the version that sampled each token; None: policy_versions
    # (N, T) bool, the tokens the model sampled (what trains); None: every real token. An episode's environment
    # tokens are in the forward passes as context and nowhere else.
    response_mask: torch.Tensor | None = None
    turns: torch.Tensor | None = None  # (N,) the model's turns in each response; None: 1 each
    environment_reward: torch.Tensor | None = None  # (N,) what each episode's environment returned; None: 0

    @classmethod
    def from_message(cls, msg: ExperienceBatch) -> Experience:
        t = torch.from_numpy
        return cls(
            t(msg.row_versions()),
            t(msg.prompt_tokens),
            t(msg.prompt_lengths),
            t(msg.response_tokens),
            t(msg.response_lengths),
            t(msg.finished),
            t(msg.behaviour_logprobs),
            t(msg.scores),
            t(msg.kl),
            t(msg.values),
            t(msg.advantages),
            t(msg.returns),
            t(msg.ref_logprobs),
            t(msg.token_versions.astype("int64")),
            t(msg.response_mask),
            t(msg.turns),
            t(msg.environment_reward),
        )

    def to(self, device) -> Experience:
        tensors = (getattr(self, f.name) for f in dataclasses.fields(self))
        return Experience(*(t.to(device) if t is not None else None for t in tensors))

    @property
    def rows(self) -> int:
        return len(self.response_lengths)

    def nbytes(self) -> int:
        tensors = (getattr(self, f.name) for f in dataclasses.fields(self))
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def take(self, rows: torch.Tensor) -> Experience:
        """The sequences at ``rows``."""
        tensors = (getattr(self, f.name) for f in dataclasses.fields(self))
        return Experience(*(t[rows] if t is not None else None for t in tensors))

    @staticmethod
    def concat(parts: list[Experience]) -> Experience:
        """The sequences of ``parts`` in one batch, each 2-D field right-padded with zeros to the widest part."""
        fields = []
        for f in dataclasses.fields(Experience):
            tensors = [getattr(part, f.name) for part in parts]
            if any(t is None for t in tensors):
                fields.append(None)
                continue
            if tensors[0].dim() == 2:
                width = max(t.shape[1] for t in tensors)
                tensors = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors]
            fields.append(torch.cat(tensors))
        return Experience(*fields)

    @property
    def mask(self) -> torch.Tensor:
        """``(N, T)`` float, 1 at the tokens that train: the model's."""
        if self.response_mask is not None:
            return self.response_mask.to(torch.float32)
        return lengths_to_mask(self.response_lengths, self.response_tokens.shape[1])


@dataclass(frozen=True)
class PreparedBatch:
    """One experience batch made ready for the epochs (the trainer's ``_prepare``): ``N`` sequences, responses of
    length ``T``."""

    packed: PackedSequences  # prompt + response, left-aligned, for the forward passes
    mask: torch.Tensor  # (N, T) 1.0 at response tokens
    advantages: torch.Tensor  # (N, T) whitened if configured
    old_logp: torch.Tensor  # (N, T) log π_old, recomputed by the learner before the first step
    importance: torch.Tensor  # (N, T) the off-policy correction's weights (1 where none applies)
    staleness: torch.Tensor  # (N,) learner version − the version that sampled each sequence (< 0: rolled back)
    correction: dict[str, float]  # what the off-policy correction did, for the update's statistics


def experience_statistics(
    exp: Experience, batch: PreparedBatch, kl_per_sequence: torch.Tensor, kl_coef: float, critic: bool, version: int
) -> dict[str, float]:
    """What the experience itself says: reward, KL, critic fit, lengths, the sampler/learner log-prob gap."""
    mask, n = batch.mask, len(batch.mask)
    gap = (batch.old_logp - exp.behaviour_logprobs).abs()  # the sampler's log-probs against the learner's
    return {
        "reward_mean": float(exp.scores.mean()),
        "reward_std": float(exp.scores.std()) if n > 1 else 0.0,
        "kl": float(ppo.masked_mean(exp.kl, mask)),
        "kl_per_sequence": float(kl_per_sequence.mean()),
        "kl_coef": kl_coef,
        **({"explained_variance": float(ppo.explained_variance(exp.values, exp.returns, mask))} if critic else {}),
        "advantage_mean": float(ppo.masked_mean(exp.advantages, mask)),
        "response_length": float(mask.sum(dim=1).mean()) if n else 0.0,  # the model's tokens
        "finished_frac": float(exp.finished.float().mean()),
        # Episodes (1 turn and 0 for single answers): the model's turns, and the environment's reward.
        "turns_mean": float(exp.turns.float().mean()) if exp.turns is not None and n else 1.0,
        "environment_reward_mean": (
            float(exp.environment_reward.mean()) if exp.environment_reward is not None and n else 0.0
        ),
        "logprob_mismatch": float(ppo.masked_mean(gap, mask)),
        "logprob_mismatch_max": float((gap * mask).max()) if n else 0.0,
        **batch.correction,
        "staleness": float(batch.staleness.float().mean()),
        # Sequences whose tokens more than one version sampled: new weights landed while they were sampled.
        "sampled_across_updates": float(_across_versions(exp, mask).float().mean()) if n else 0.0,
        "policy_version": float(version),
    }


def _across_versions(exp: Experience, mask: torch.Tensor) -> torch.Tensor:
    """``(N,)`` whether more than one version sampled the tokens of each sequence."""
    if exp.token_versions is None:
        return torch.zeros(exp.rows, dtype=torch.bool)
    newest = torch.where(mask.bool(), exp.token_versions, exp.policy_versions.unsqueeze(-1)).amax(-1)
    return newest > exp.policy_versions
