"""The advantage service's core: from scores, log-probs and values to token rewards and advantages.

Pure tensor code around :mod:`common.ppo`; the critic forward pass lives in :mod:`common.sequences`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common import ppo

__all__ = ["Estimate", "ShapingParams", "estimate_advantages"]


@dataclass(frozen=True)
class ShapingParams:
    kl_coef: float
    kl_estimator: str = "k1"
    gamma: float = 1.0
    lam: float = 0.95
    score_clip: float | None = None
    missing_eos_penalty: float | None = None
    estimator: str = "gae"
    kl_in: str = "reward"  # "loss": the learner adds the KL term to its loss, the rewards carry none


@dataclass(frozen=True)
class Estimate:
    kl: torch.Tensor  # (N, T)
    token_rewards: torch.Tensor  # (N, T)
    advantages: torch.Tensor  # (N, T), not whitened by the learner's switch (an estimator may whiten its own)
    returns: torch.Tensor  # (N, T)


def estimate_advantages(
    scores: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    finished: torch.Tensor,
    group_index: torch.Tensor,
    params: ShapingParams,
) -> Estimate:
    """Shapes: ``scores``, ``finished`` and ``group_index`` ``(N,)``; everything else ``(N, T)``. ``values`` are
    zeros in a critic-free run."""
    if params.missing_eos_penalty is not None:
        scores = ppo.missing_eos_penalty(scores, finished, params.missing_eos_penalty)
    kl = ppo.kl_estimate(behaviour_logprobs, ref_logprobs, params.kl_estimator) * mask
    beta = params.kl_coef if params.kl_in == "reward" else 0.0
    rewards = ppo.token_rewards(scores, kl, mask, beta, clip=params.score_clip)
    advantages, returns = ppo.ADVANTAGE_ESTIMATORS[params.estimator].fn(
        ppo.EstimatorInput(rewards, values, mask, group_index),
        ppo.EstimatorParams(gamma=params.gamma, lam=params.lam),
    )
    return Estimate(kl, rewards, advantages, returns)
