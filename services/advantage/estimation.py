"""The advantage service's core: from scores, log-probs and values to token rewards and advantages.

Pure tensor code around :mod:`common.ppo`; the critic forward pass lives in :mod:`common.sequences`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common import ppo
from common.algorithms import ESTIMATORS
from common.config import AlgorithmSection

__all__ = ["Estimate", "estimate_advantages", "shaping_lineage"]


@dataclass(frozen=True)
class Estimate:
    kl: torch.Tensor  # (N, T)
    token_rewards: torch.Tensor  # (N, T)
    advantages: torch.Tensor  # (N, T), not whitened by the learner's switch (an estimator may whiten its own)
    returns: torch.Tensor  # (N, T)
    no_signal: torch.Tensor  # (N,) bool: in a group whose scores are all equal (only with dynamic_sampling)


def estimate_advantages(
    scores: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    finished: torch.Tensor,
    group_index: torch.Tensor,
    algorithm: AlgorithmSection,
    kl_coef: float,
    max_new_tokens: int,
) -> Estimate:
    """Shapes: ``scores``, ``finished`` and ``group_index`` ``(N,)``; everything else ``(N, T)``. ``values`` are
    zeros in a critic-free run. ``kl_coef`` is the learner's current β (it adapts), ``max_new_tokens`` the longest
    response the generator may sample; everything else comes from the ``algorithm`` section, the chosen estimator
    receiving the settings its declaration names."""
    if algorithm.missing_eos_penalty is not None:
        scores = ppo.missing_eos_penalty(scores, finished, algorithm.missing_eos_penalty)
    if algorithm.overlong_buffer is not None:
        lengths = mask.sum(dim=-1)
        scores = ppo.overlong_penalty(
            scores, lengths, max_new_tokens, algorithm.overlong_buffer, algorithm.overlong_penalty
        )
    kl = ppo.kl_estimate(behaviour_logprobs, ref_logprobs, algorithm.kl_estimator) * mask
    beta = kl_coef if algorithm.kl_in == "reward" else 0.0
    rewards = ppo.token_rewards(scores, kl, mask, beta, clip=algorithm.score_clip)
    advantages, returns = ppo.ADVANTAGE_ESTIMATORS[algorithm.estimator](
        ppo.EstimatorInput(rewards, values, mask, group_index), **ESTIMATORS.settings(algorithm)
    )
    no_signal = torch.zeros(len(scores), dtype=torch.bool)
    if algorithm.dynamic_sampling:
        clipped = scores.clamp(-algorithm.score_clip, algorithm.score_clip) if algorithm.score_clip else scores
        no_signal = ppo.groups_without_signal(clipped, group_index)
    return Estimate(kl, rewards, advantages, returns, no_signal)


def shaping_lineage(algorithm: AlgorithmSection, kl_coef: float) -> dict:
    """What an experience batch records of how its rewards and advantages were made: ``shaping.<setting>``."""
    settings = algorithm.model_dump(exclude={"adaptive_kl"}) | {"kl_coef": kl_coef}
    return {f"shaping.{name}": value for name, value in settings.items()}
