"""The PPO math of RLHF: pure functions over ``(batch, response_len)`` tensors.

Nothing here does I/O or knows about services or transport. Conventions, as in verl's ``core_algos.py``:

- ``B`` is the number of sequences, ``T`` the padded response length, ``V`` the vocabulary size.
- ``mask`` is ``(B, T)``, 1.0 for real response tokens and 0.0 for padding. Padding is usually on the right,
  but every function here treats the mask position by position, so gaps are handled too.
- ``logp[b, t]`` is the log-probability of response token ``t`` given the prompt and tokens ``< t``.
- ``values[b, t]`` is the critic's ``V(s_t)``: the value of the state *before* token ``t`` is chosen.

The equations are summarised in ``docs/ARCHITECTURE.md`` ("The math") and follow Schulman et al. 2017 (PPO),
Schulman et al. 2016 (GAE), Ziegler et al. 2019 (KL-shaped rewards, adaptive KL controller).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common import algorithms

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "Registry",
    "AdaptiveKLController",
    "EstimatorInput",
    "FixedKLController",
    "agg_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "group_mean_std",
    "lr_factor",
    "groups_without_signal",
    "cispo_loss",
    "grpo",
    "gspo_loss",
    "kl_estimate",
    "last_token_index",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "missing_eos_penalty",
    "off_policy_weights",
    "overlong_penalty",
    "policy_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "token_own_rewards",
    "token_rewards",
    "value_loss",
]


class Registry(dict):
    """The functions of one kind of variant (:data:`common.algorithms.KINDS`), by declared name.

    Registering a name that is not declared, or twice, is an error: the declaration is where a variant's needs and
    settings are stated, and its function receives exactly those settings as keyword arguments.
    """

    def __init__(self, kind: algorithms.Kind):
        super().__init__()
        self.kind = kind

    def register(self, name: str):
        def decorator(fn):
            self.kind[name]  # declared, or a ValueError naming the declared ones
            if name in self:
                raise ValueError(f"{self.kind.title} {name!r} is already registered")
            self[name] = fn
            return fn

        return decorator

    def __missing__(self, name: str):
        raise ValueError(f"no function registered for {self.kind.title} {name!r}; registered: {', '.join(self)}")


ADVANTAGE_ESTIMATORS = Registry(algorithms.ESTIMATORS)
POLICY_LOSSES = Registry(algorithms.POLICY_LOSSES)
LOSS_AGGREGATIONS = Registry(algorithms.LOSS_AGGREGATIONS)
KL_ESTIMATORS = Registry(algorithms.KL_ESTIMATORS)
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
register_policy_loss = POLICY_LOSSES.register


# --------------------------------------------------------------------------------------------- masked statistics


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1.

    Args:
        x: ``(B, T)`` (any shape broadcastable with ``mask``).
        mask: ``(B, T)``, 0/1.
        dim: reduce over this dimension only; ``None`` reduces over all.
    Returns:
        a scalar, or ``x`` reduced over ``dim``. An all-zero mask gives 0, not NaN.
    """
    mask = mask.to(x.dtype)
    total = (x * mask).sum(dim=dim) if dim is not None else (x * mask).sum()
    count = mask.sum(dim=dim) if dim is not None else mask.sum()
    return total / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over the masked positions (``(B, T)`` in, scalar out), Bessel-corrected by default."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count > 1:
            var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance over the masked positions of the whole batch.

    Args:
        x: ``(B, T)``.
        mask: ``(B, T)``.
        shift_mean: if False, only scale (keeps the sign of the mean, as some implementations do).
    Returns:
        ``(B, T)``, zero at padding.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row.

    Args:
        mask: ``(B, T)``.
    Returns:
        ``(B,)`` long; -1 for a row with no real token.
    """
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    index = torch.where(mask.bool(), positions, torch.full_like(positions, -1))
    return index.max(dim=-1).values


# --------------------------------------------------------------------------------------------- log-probs, KL


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each chosen token.

    Args:
        logits: ``(B, T, V)``; ``logits[b, t]`` is the distribution that produced ``tokens[b, t]`` (the caller has
            already shifted by one: the logits at sequence position ``p - 1`` predict the token at ``p``).
        tokens: ``(B, T)`` long.
    Returns:
        ``(B, T)`` float32: ``log_softmax(logits)[tokens]``.
    """
    logits = logits.float()
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    # logsumexp instead of a full log_softmax: one (B, T) result instead of another (B, T, V) tensor.
    return chosen - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position: ``(B, T, V)`` -> ``(B, T)``."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


@KL_ESTIMATORS.register("k1")
def _kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def _kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def _kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # Schulman's unbiased, always non-negative estimator; the clamp of its input keeps exp() finite on wild inputs.
    # Its value is not clamped (verl clamps it to [-10, 10]): a clamp there zeroes the gradient of exactly the
    # tokens that moved furthest from the reference (KL in the loss), and hides how far they moved from the metrics.
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(log_ratio) - log_ratio - 1.0


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(actor || reference) from the log-probs of the sampled tokens.

    Args:
        logp: ``(B, T)`` actor (behaviour) log-probs.
        ref_logp: ``(B, T)`` reference log-probs of the same tokens.
        kind: ``k1`` = logp − ref; ``k2`` = ½(logp − ref)²; ``k3`` = exp(ref − logp) − (ref − logp) − 1.
    Returns:
        ``(B, T)``. Padding positions are not masked here; multiply by the mask where it matters.
    """
    return KL_ESTIMATORS[kind](logp, ref_logp)


# --------------------------------------------------------------------------------------------- rewards


def missing_eos_penalty(scores: torch.Tensor, finished: torch.Tensor, penalty: float) -> torch.Tensor:
    """Subtract ``penalty`` from the score of every response that ended without EOS (was truncated).

    Args:
        scores: ``(B,)`` reward-model scores.
        finished: ``(B,)`` bool, True where the response ended with EOS.
    Returns:
        ``(B,)``.
    """
    return scores - penalty * (~finished.bool()).to(scores.dtype)


def overlong_penalty(
    scores: torch.Tensor, lengths: torch.Tensor, max_length: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025): a response longer than ``max_length − buffer`` loses
    ``penalty · (length − (max_length − buffer)) / buffer`` of its score, ``penalty`` at ``max_length``.

    Args:
        scores: ``(B,)``.
        lengths: ``(B,)`` response lengths in tokens.
        max_length: the longest response the sampler may produce.
        buffer: how many tokens before ``max_length`` the penalty starts.
    Returns:
        ``(B,)``.
    """
    excess = (lengths.to(scores.dtype) - (max_length - buffer)).clamp(min=0.0)
    return scores - penalty * excess / buffer


def token_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float | torch.Tensor,
    clip: float | None = None,
) -> torch.Tensor:
    """KL-shaped per-token rewards: ``r_t = −β·kl_t`` on every real token, plus the score on the last real token.

    Args:
        scores: ``(B,)`` sequence-level scores from the reward model.
        kl: ``(B, T)`` per-token KL estimates (see :func:`kl_estimate`).
        mask: ``(B, T)``.
        kl_coef: β, a float or a ``(B,)`` tensor.
        clip: if set, scores are clamped to ``[−clip, clip]`` first.
    Returns:
        ``(B, T)`` rewards, zero at padding.
    """
    mask = mask.to(kl.dtype)
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    beta = torch.as_tensor(kl_coef, dtype=kl.dtype, device=kl.device)
    if beta.ndim == 1:
        beta = beta.unsqueeze(-1)
    rewards = -beta * kl * mask
    last = last_token_index(mask)
    rows = torch.nonzero(last >= 0, as_tuple=True)[0]
    rewards[rows, last[rows]] += scores[rows].to(kl.dtype)
    return rewards


# --------------------------------------------------------------------------------------------- advantages


@dataclass(frozen=True)
class EstimatorInput:
    """What an advantage estimator may use, for ``N`` sequences of ``T`` response tokens.

    An estimator is ``fn(input: EstimatorInput, **settings) -> (advantages, returns)``, each ``(N, T)`` and zero at
    padding, registered with :func:`register_advantage_estimator` under the name of its declaration in
    :data:`common.algorithms.ESTIMATORS`, which lists the settings it is given.
    """

    token_rewards: torch.Tensor
    """``(N, T)``: each sequence's score on its last real token, and ``−β·kl_t`` on every token when the KL penalty
    is in the reward (:func:`token_rewards`)."""
    values: torch.Tensor
    """``(N, T)`` critic values ``V(s_t)``; zeros in a critic-free run."""
    mask: torch.Tensor
    """``(N, T)``."""
    group_index: torch.Tensor
    """``(N,)`` the prompt each response was sampled for: responses with one index form a group."""


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over the real tokens of each row.

    ``δ_t = r_t + γ·V_{t+1} − V_t`` with ``V = 0`` after the last real token; ``A_t = δ_t + γλ·A_{t+1}``;
    ``R_t = A_t + V_t``. Masked positions are skipped (neither their value nor their advantage is carried), so
    right padding, and gaps, are handled. No whitening here: see :func:`masked_whiten`.

    Args:
        rewards: ``(B, T)`` token rewards (see :func:`token_rewards`).
        values: ``(B, T)`` critic values ``V(s_t)`` recorded with the experience.
        mask: ``(B, T)``.
        gamma: discount γ (1.0 is the usual LLM default).
        lam: GAE λ (0.95 is usual).
    Returns:
        ``(advantages, returns)``, each ``(B, T)``, zero at padding.
    """
    with torch.no_grad():
        mask = mask.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])
        next_advantage = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            advantage = delta + gamma * lam * next_advantage
            m = mask[:, t]
            # At a padding position keep carrying what follows it, so the last real token sees V = 0, A = 0.
            next_value = m * values[:, t] + (1.0 - m) * next_value
            next_advantage = m * advantage + (1.0 - m) * next_advantage
            advantages[:, t] = advantage
        advantages = advantages * mask
        returns = (advantages + values) * mask
    return advantages, returns


def group_mean_std(scores: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence, the mean, the (Bessel-corrected) standard deviation and the size of its group's scores.

    A group of one has mean 0 and std 1, as in verl's ``core_algos.py`` (its advantage is its score). A group whose
    scores are all equal has ``score − mean`` and std exactly 0 in any dtype: the statistics are taken of each score
    less its group's first score (exactly 0 for equal scores), not of the scores themselves, whose sum rounds (six
    float32 scores of 2.1 have a mean of 2.0999999, and GRPO's ``(s − mean) / (std + ε)`` would give them ±0.19).

    Args:
        scores: ``(N,)``.
        group_index: ``(N,)``, any integers; equal ones form a group.
    Returns:
        ``(mean, std, size)``, each ``(N,)``.
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max()) + 1 if len(inverse) else 0
    size = torch.zeros(groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, torch.ones_like(scores))
    position = torch.arange(len(scores), device=scores.device)
    first = torch.full((groups,), len(scores), device=scores.device).scatter_reduce_(0, inverse, position, "amin")
    shift = scores[first]
    offsets = scores - shift[inverse]
    offset_mean = torch.zeros_like(size).index_add_(0, inverse, offsets) / size
    squares = torch.zeros_like(size).index_add_(0, inverse, (offsets - offset_mean[inverse]) ** 2)
    std = torch.sqrt(squares / (size - 1).clamp(min=1.0))
    mean = shift + offset_mean
    single = size == 1
    mean, std = torch.where(single, 0.0, mean), torch.where(single, 1.0, std)
    return mean[inverse], std[inverse], size[inverse]


def groups_without_signal(scores: torch.Tensor, group_index: torch.Tensor, tolerance: float = 1e-6) -> torch.Tensor:
    """Which responses belong to a group whose scores are all equal: a group baseline gives every one of them zero
    advantage, so the group teaches nothing (DAPO's dynamic sampling drops such groups).

    Args:
        scores: ``(N,)``, the scores the estimator sees (penalised and clipped).
        group_index: ``(N,)``; equal ones form a group.
        tolerance: the largest standard deviation that counts as equal scores.
    Returns:
        ``(N,)`` bool; a group of one is never without signal (its advantage is its score).
    """
    _, std, size = group_mean_std(scores, group_index)
    return (size > 1) & (std <= tolerance)


def _outcome(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(N,)``: the sum of each sequence's token rewards (its score, less the KL penalty when it is in the reward)."""
    return (token_rewards * mask.to(token_rewards.dtype)).sum(dim=-1)


def grpo(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_index: torch.Tensor,
    eps: float = 1e-6,
    scale_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): ``A_i = (s_i − mean_g) / (std_g + ε)`` on every token of response ``i``, where ``s_i``
    is its outcome (summed token rewards) and ``g`` its group (the ``n`` samples of one prompt).

    With ``scale_by_std=False`` it is Dr. GRPO's advantage (Liu et al. 2025): ``A_i = s_i − mean_g``.

    Args:
        token_rewards: ``(N, T)``.
        mask: ``(N, T)``.
        group_index: ``(N,)``.
    Returns:
        ``(advantages, returns)``, each ``(N, T)`` and equal, zero at padding.
    """
    with torch.no_grad():
        scores = _outcome(token_rewards, mask)
        mean, std, _ = group_mean_std(scores, group_index)
        advantages = scores - mean
        if scale_by_std:
            advantages = advantages / (std + eps)
        advantages = advantages.unsqueeze(-1) * mask.to(scores.dtype)
    return advantages, advantages


def rloo(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): ``A_i = s_i − mean_{j≠i} s_j = n/(n−1)·(s_i − mean_g)`` over its group of ``n``;
    a group of one keeps its score.

    Args:
        token_rewards: ``(N, T)``.
        mask: ``(N, T)``.
        group_index: ``(N,)``.
    Returns:
        ``(advantages, returns)``, each ``(N, T)`` and equal, zero at padding.
    """
    with torch.no_grad():
        scores = _outcome(token_rewards, mask)
        mean, _, size = group_mean_std(scores, group_index)
        factor = torch.where(size > 1, size / (size - 1).clamp(min=1.0), 1.0)
        advantages = torch.where(size > 1, factor * (scores - mean), scores)
        advantages = advantages.unsqueeze(-1) * mask.to(scores.dtype)
    return advantages, advantages


def reinforce_pp(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns of the KL-shaped token rewards, ``R_t = r_t + γ·R_{t+1}`` within
    each response, whitened over the whole batch to give the advantages. ``t + 1`` is the next masked-in position:
    an episode's environment tokens are skipped, not a reset (as in :func:`gae`).

    Args:
        token_rewards: ``(N, T)``.
        mask: ``(N, T)``.
        gamma: discount γ.
    Returns:
        ``(advantages, returns)``, each ``(N, T)``, zero at padding.
    """
    with torch.no_grad():
        mask = mask.to(token_rewards.dtype)
        returns = torch.zeros_like(token_rewards)
        running = torch.zeros_like(token_rewards[:, 0])
        for t in reversed(range(token_rewards.shape[1])):
            m = mask[:, t]
            running = m * (token_rewards[:, t] + gamma * running) + (1.0 - m) * running
            returns[:, t] = running * m
        advantages = masked_whiten(returns, mask)
    return advantages, returns


def reinforce_pp_baseline(
    token_rewards: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025): ``s_i − mean_g`` on every token of response ``i``, then whitened
    over the whole batch.

    Args:
        token_rewards: ``(N, T)``.
        mask: ``(N, T)``.
        group_index: ``(N,)``.
    Returns:
        ``(advantages, returns)``, each ``(N, T)`` and equal, zero at padding.
    """
    with torch.no_grad():
        scores = _outcome(token_rewards, mask)
        mean, _, _ = group_mean_std(scores, group_index)
        centred = (scores - mean).unsqueeze(-1) * mask.to(scores.dtype)
        advantages = masked_whiten(centred, mask)
    return advantages, advantages


def token_own_rewards(token_rewards: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's own reward, ``r_t``, as its advantage: no discount, no sum over the tokens after it; whitened over
    the batch's tokens (the mean a baseline, which leaves the expected gradient as it is).

    With the reference model a teacher, the KL in the rewards (``kl_in: reward``, k1) and β = 1, ``r_t = −(log π −
    log π_teacher)`` (plus any score on the last token): the per-token reverse KL to the teacher, on-policy
    distillation's signal (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025). Without the baseline every
    advantage is negative where the student puts more mass than the teacher on what it samples, which is most
    tokens, and the update mostly pushes mass off whatever was sampled (towards ending early, say).

    Args:
        token_rewards: ``(N, T)``.
        mask: ``(N, T)``.
    Returns:
        ``(advantages, returns)``: the whitened rewards and the rewards themselves, each ``(N, T)``, zero at padding.
    """
    with torch.no_grad():
        returns = token_rewards * mask.to(token_rewards.dtype)
        advantages = masked_whiten(returns, mask)
    return advantages, returns


register_advantage_estimator("gae")(lambda x, gamma, lam: gae(x.token_rewards, x.values * x.mask, x.mask, gamma, lam))
register_advantage_estimator("grpo")(lambda x: grpo(x.token_rewards, x.mask, x.group_index))
register_advantage_estimator("dr_grpo")(lambda x: grpo(x.token_rewards, x.mask, x.group_index, scale_by_std=False))
register_advantage_estimator("rloo")(lambda x: rloo(x.token_rewards, x.mask, x.group_index))
register_advantage_estimator("reinforce_pp")(lambda x, gamma: reinforce_pp(x.token_rewards, x.mask, gamma))
register_advantage_estimator("distill")(lambda x: token_own_rewards(x.token_rewards, x.mask))
register_advantage_estimator("reinforce_pp_baseline")(
    lambda x: reinforce_pp_baseline(x.token_rewards, x.mask, x.group_index)
)


# --------------------------------------------------------------------------------------------- losses


@LOSS_AGGREGATIONS.register("token-mean")
def _token_mean(loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None, norm_length: int | None):
    denominator = mask.sum().clamp(min=1.0) if num_tokens is None else max(float(num_tokens), 1.0)
    return (loss * mask).sum() / denominator


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None, norm_length: int | None):
    return (loss * mask).sum(dim=-1).mean()


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None, norm_length: int | None):
    return masked_mean(loss, mask, dim=-1).mean()


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, num_tokens: float | None, norm_length: int | None):
    if norm_length is None or norm_length < 1:
        raise ValueError("seq-mean-token-sum-norm needs norm_length, the longest response (≥ 1)")
    return (loss * mask).sum(dim=-1).mean() / norm_length


def agg_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    num_tokens: float | None = None,
    norm_length: int | None = None,
):
    """Reduce a ``(B, T)`` per-token loss to a scalar.

    Args:
        loss: ``(B, T)``.
        mask: ``(B, T)``.
        mode: a declared loss aggregation (:data:`common.algorithms.LOSS_AGGREGATIONS`): ``token-mean`` (every real
            token of the batch weighs the same), ``seq-mean-token-sum``, ``seq-mean-token-mean`` (every sequence
            weighs the same), or ``seq-mean-token-sum-norm`` (Dr. GRPO: each sequence's token sum divided by the
            constant ``norm_length``, then the mean over sequences, so neither a response's length nor the batch's
            padding changes a token's weight).
        num_tokens: for ``token-mean`` under gradient accumulation, the number of real tokens of the *whole*
            mini-batch, so that the micro-batch losses add up to the global token mean. Default: ``mask.sum()``.
        norm_length: for ``seq-mean-token-sum-norm``: the longest response the sampler may produce.
    """
    return LOSS_AGGREGATIONS[mode](loss, mask.to(loss.dtype), num_tokens, norm_length)


@dataclass(frozen=True)
class OffPolicyStats:
    masked_tokens: torch.Tensor
    """Share of the corrected tokens whose weight is 0: outside a band, or in a response masked whole."""
    masked_sequences: torch.Tensor
    """Share of the responses with a corrected token that a sequence band masked whole."""
    weight_mean: torch.Tensor
    """Mean weight over the corrected tokens."""


def _outside(values: torch.Tensor, band: tuple[float, float] | None) -> torch.Tensor:
    if band is None:
        return torch.zeros_like(values, dtype=torch.bool)
    return (values < band[0]) | (values > band[1])


def off_policy_weights(
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    corrected: torch.Tensor,
    token_cap: float | None = 2.0,
    token_band: tuple[float, float] | None = None,
    sequence_band: tuple[float, float] | None = None,
    geometric_band: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, OffPolicyStats]:
    """Per-token weights that correct for sampling by another policy than π_old (a stale version, or the sampler's
    own numerics, which never match the learner's exactly), from ``r_t = π_old / π_behaviour``, no gradient:

    - ``token_cap``: truncated importance sampling, ``min(r_t, C)`` (decoupled PPO; verl's token TIS);
    - ``token_band``: a token whose ``r_t`` is outside ``[lo, hi]`` gets 0 (IcePop's token mask);
    - ``sequence_band``: a response whose ``∏ r_t`` is outside gets 0 on every token (sequence-level masking);
    - ``geometric_band``: the same on the geometric mean ``exp(mean_t log r_t)``, which does not shrink and grow
      with the response's length.

    Only the ``corrected`` tokens are weighed (the others get 1), and a response's products and means run over them.

    Args:
        old_logp, behaviour_logp: ``(B, T)`` the learner's π_old and the sampler's log-probs of the same tokens.
        corrected: ``(B, T)`` bool, the real tokens to correct (all of them, or those of a stale version).
    Returns:
        ``(weights, stats)``; ``weights`` ``(B, T)``, 1 outside ``corrected``.
    """
    with torch.no_grad():
        corrected = corrected.bool()
        log_ratio = torch.where(corrected, (old_logp - behaviour_logp).clamp(-20.0, 20.0), 0.0)
        ratio = torch.exp(log_ratio)
        weights = ratio.clamp(max=token_cap) if token_cap is not None else torch.ones_like(ratio)
        keep = ~_outside(ratio, token_band)
        count = corrected.sum(dim=-1)
        sequence_out = _outside(torch.exp(log_ratio.sum(dim=-1)), sequence_band)
        sequence_out |= _outside(torch.exp(log_ratio.sum(dim=-1) / count.clamp(min=1)), geometric_band)
        sequence_out &= count > 0
        keep &= ~sequence_out.unsqueeze(-1)
        weights = torch.where(corrected, weights * keep, 1.0)
        n = corrected.sum().clamp(min=1)
        stats = OffPolicyStats(
            masked_tokens=((weights == 0) & corrected).sum() / n,
            masked_sequences=sequence_out.sum() / (count > 0).sum().clamp(min=1),
            weight_mean=(weights * corrected).sum() / n,
        )
    return weights, stats


@dataclass(frozen=True)
class PolicyLossStats:
    clip_frac: torch.Tensor
    """Share of real tokens where the clip acted (the clipped term was taken, or the ratio was clipped)."""
    approx_kl: torch.Tensor
    """Masked mean of ``k3(π_new, π_old)``: how far this update moved the policy."""
    dual_clip_frac: torch.Tensor
    """Share of real tokens whose loss was bounded by the dual clip."""


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float, mask_f: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token ``max(−ρ·A, −clip(ρ, 1−ε_low, 1+ε_high)·A)``, ``(B, T)``, and the share of real tokens where
    the clipped term was taken."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), masked_mean((clipped > unclipped).to(ratio.dtype), mask_f)


def _finish_policy_loss(
    losses: torch.Tensor,
    log_ratio: torch.Tensor,
    mask_f: torch.Tensor,
    clip_frac: torch.Tensor,
    importance_weights: torch.Tensor | None,
    agg: str,
    num_tokens: float | None,
    norm_length: int | None,
    dual_clip_frac: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """What every policy loss does last: the off-policy correction multiplied in, the aggregation, the stats."""
    if importance_weights is not None:
        losses = losses * importance_weights
    loss = agg_loss(losses, mask_f, agg, num_tokens, norm_length)
    with torch.no_grad():
        approx_kl = masked_mean(torch.exp(-log_ratio) - 1.0 + log_ratio, mask_f)
    if dual_clip_frac is None:
        dual_clip_frac = torch.zeros((), dtype=losses.dtype, device=losses.device)
    return loss, PolicyLossStats(clip_frac.detach(), approx_kl, dual_clip_frac.detach())


@register_policy_loss("ppo")
def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    importance_weights: torch.Tensor | None = None,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO clipped surrogate: ``−min(ratio·A, clip(ratio, 1−ε_low, 1+ε_high)·A)`` per token, aggregated.

    Registered as the policy loss ``ppo``. A policy loss is ``fn(logp, old_logp, advantages, mask, *,
    importance_weights, agg, num_tokens, norm_length, **settings) -> (loss, PolicyLossStats)``, its settings those
    of its declaration in :data:`common.algorithms.POLICY_LOSSES`.

    Args:
        logp: ``(B, T)`` log-probs under the policy being trained (with gradient).
        old_logp: ``(B, T)`` log-probs under π_old, the policy at the start of this update.
        advantages: ``(B, T)``.
        mask: ``(B, T)``.
        clip_low, clip_high: ε_low and ε_high (asymmetric clipping, "clip-higher").
        dual_clip: c > 1: for ``A < 0`` the loss is bounded by ``−c·A`` (Ye et al. 2020).
        importance_weights: ``(B, T)`` off-policy correction multiplied into the per-token loss.
        agg, num_tokens, norm_length: see :func:`agg_loss`.
    Returns:
        ``(loss, stats)``; ``loss`` is a scalar with gradient w.r.t. ``logp``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask_f = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    losses, clip_frac = _clipped_surrogate(torch.exp(log_ratio), advantages, clip_low, clip_high, mask_f)
    dual_clip_frac = None
    if dual_clip is not None:
        bound = -advantages * dual_clip
        bounded = torch.minimum(losses, bound)
        negative = advantages < 0
        dual_clip_frac = masked_mean(((losses > bound) & negative).to(logp.dtype), mask_f)
        losses = torch.where(negative, bounded, losses)
    return _finish_policy_loss(
        losses, log_ratio, mask_f, clip_frac, importance_weights, agg, num_tokens, norm_length, dual_clip_frac
    )


@register_policy_loss("gspo")
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    gspo_clip_low: float = 3e-4,
    gspo_clip_high: float = 4e-4,
    importance_weights: torch.Tensor | None = None,
    agg: str = "seq-mean-token-mean",
    num_tokens: float | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """GSPO (Zheng et al. 2025), in its token form: one importance ratio per response, the geometric mean of its
    token ratios ``s_i = exp(mean_t (log π − log π_old))``, clipped as PPO clips a token's ratio.

    ``s_{i,t} = sg[s_i] · π(y_t) / sg[π(y_t)]``: its value is ``s_i`` on every token, its gradient ``s_i·∇log π(y_t)``,
    so that aggregated ``seq-mean-token-mean`` (as the paper and verl do) the gradient is the paper's. As in verl the
    log of the ratio is clamped at 10. Its ε are settings of their own (``learner.gspo_clip_low``, ``gspo_clip_high``),
    about 1000× smaller than PPO's (the paper's 3e-4 and 4e-4), since a response's mean log-ratio moves far less
    than a token's.

    Args, returns: as :func:`policy_loss` (no dual clip). Shapes ``(B, T)``.
    """
    mask_f = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    sequence_log_ratio = (log_ratio * mask_f).sum(dim=-1) / mask_f.sum(dim=-1).clamp(min=1.0)  # (B,)
    token_log_ratio = (logp - logp.detach() + sequence_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = torch.exp(token_log_ratio)
    losses, clip_frac = _clipped_surrogate(ratio, advantages, gspo_clip_low, gspo_clip_high, mask_f)
    return _finish_policy_loss(
        losses, log_ratio.clamp(-20.0, 20.0), mask_f, clip_frac, importance_weights, agg, num_tokens, norm_length
    )


@register_policy_loss("cispo")
def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    importance_weights: torch.Tensor | None = None,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """CISPO (MiniMax-M1, 2025): ``−sg[clip(ratio, 1−ε_low, 1+ε_high)]·A·log π`` per token.

    The clip bounds the importance weight, not the update: every token keeps a gradient (``−clip(ratio)·A·∇log π``),
    where PPO's clip zeroes it on the tokens it clips, often the rare, high-information ones. The loss's value is
    not a surrogate objective's (it carries ``log π``); only its gradient means something. As in verl, both bounds
    apply (the paper leaves the lower one wide).

    Args, returns: as :func:`policy_loss` (no dual clip). Shapes ``(B, T)``.
    """
    mask_f = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    losses = -weight.detach() * advantages * logp
    clip_frac = masked_mean((weight != ratio).to(logp.dtype), mask_f)
    return _finish_policy_loss(losses, log_ratio, mask_f, clip_frac, importance_weights, agg, num_tokens, norm_length)


@dataclass(frozen=True)
class ValueLossStats:
    clip_frac: torch.Tensor
    """Share of real tokens where the clipped value's error was the larger one."""


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, ValueLossStats]:
    """Clipped value loss ``½·max((V − R)², (clip(V, V_old ± ε_v) − R)²)``, aggregated.

    Args:
        values: ``(B, T)`` critic values being trained (with gradient).
        old_values: ``(B, T)`` values recorded with the experience.
        returns: ``(B, T)`` GAE returns.
        mask: ``(B, T)``.
        clip: ε_v; ``None`` for the plain ½(V − R)².
    Returns:
        ``(loss, stats)``.
    """
    mask_f = mask.to(values.dtype)
    unclipped = (values - returns) ** 2
    if clip is None:
        losses = unclipped
        clip_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (values_clipped - returns) ** 2
        losses = torch.maximum(unclipped, clipped)
        clip_frac = masked_mean((clipped > unclipped).to(values.dtype), mask_f).detach()
    return 0.5 * agg_loss(losses, mask_f, agg, num_tokens, norm_length), ValueLossStats(clip_frac)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 − Var(R − V) / Var(R)`` over the real tokens: 1 is a perfect critic, ≤ 0 no better than a constant."""
    var_returns = masked_var(returns, mask)
    return 1.0 - masked_var(returns - values, mask) / var_returns.clamp(min=1e-8)


# --------------------------------------------------------------------------------------------- KL controllers


class FixedKLController:
    """β stays where it was set."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive β of Ziegler et al. 2019: ``β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon)``.

    ``current_kl`` is the KL of the sequences just trained on (sum over tokens, mean over sequences, as in the
    paper), ``n_steps`` the number of sequences it was measured on.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError("adaptive KL needs target > 0 and horizon > 0")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


# ---------------------------------------------------------------------------------------------- learning-rate schedule


def lr_factor(update: int, total: int, schedule: str, warmup: int = 0, min_ratio: float = 0.0) -> float:
    """The learning rate of update ``update`` (0-based) of ``total``, as a share of the configured one: a linear
    warmup over the first ``warmup`` updates, then constant, linear or cosine down to ``min_ratio`` (linear reaches
    it one update past the last, as TRL's per-step schedule does)."""
    if update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min((update - warmup) / max(total - warmup, 1), 1.0)
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
