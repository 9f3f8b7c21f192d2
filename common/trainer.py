"""The learner's core: PPO epochs over one batch of experience, for the actor and the critic.

It owns the trainable actor and critic, their optimizers, the KL controller and the policy version. No I/O:
the learner service decodes experience into :class:`Experience`, calls :meth:`PPOTrainer.train`, and publishes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common import ppo
from common.config import AlgorithmSection, LearnerSection
from common.schema import ExperienceBatch
from common.sequences import PackedSequences, lengths_to_mask, pack, response_logprobs, response_values

__all__ = ["Experience", "PPOTrainer"]


@dataclass(frozen=True)
class Experience:
    """One experience batch as tensors. ``N`` sequences, prompts ``(N, P)``, responses ``(N, T)``."""

    policy_version: int
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

    @classmethod
    def from_message(cls, msg: ExperienceBatch) -> Experience:
        t = torch.from_numpy
        return cls(
            msg.policy_version,
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
        )

    def to(self, device) -> Experience:
        return Experience(self.policy_version, *(getattr(self, f).to(device) for f in _TENSOR_FIELDS))

    @property
    def mask(self) -> torch.Tensor:
        return lengths_to_mask(self.response_lengths, self.response_tokens.shape[1])


_TENSOR_FIELDS = [f for f in Experience.__dataclass_fields__ if f != "policy_version"]


def _chunks(index: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [index[i : i + size] for i in range(0, len(index), size)]


@dataclass(frozen=True)
class _Batch:
    """One experience batch made ready for the epochs: ``N`` sequences, responses of length ``T``."""

    packed: PackedSequences  # prompt + response, left-aligned, for the forward passes
    mask: torch.Tensor  # (N, T) 1.0 at response tokens
    advantages: torch.Tensor  # (N, T) whitened if configured
    old_logp: torch.Tensor  # (N, T) log π_old, recomputed by the learner before the first step
    importance: torch.Tensor | None  # (N, T) truncated π_old / π_behaviour, for stale experience only
    staleness: int  # learner version − the version that sampled the batch
    micro: int  # sequences per forward pass


class PPOTrainer:
    def __init__(
        self,
        actor: torch.nn.Module,
        critic: torch.nn.Module,
        learner: LearnerSection,
        algorithm: AlgorithmSection,
        temperature: float,
        pad_token_id: int,
        seed: int = 0,
    ):
        self.actor, self.critic = actor, critic
        self.cfg, self.algo = learner, algorithm
        self.temperature, self.pad_token_id = temperature, pad_token_id
        self.actor_optimizer = torch.optim.AdamW(
            actor.parameters(), lr=learner.actor_lr, weight_decay=learner.weight_decay
        )
        self.critic_optimizer = torch.optim.AdamW(
            critic.parameters(), lr=learner.critic_lr, weight_decay=learner.weight_decay
        )
        if algorithm.adaptive_kl is not None:
            self.kl_controller = ppo.AdaptiveKLController(
                algorithm.kl_coef, algorithm.adaptive_kl.target, algorithm.adaptive_kl.horizon
            )
        else:
            self.kl_controller = ppo.FixedKLController(algorithm.kl_coef)
        self.version = 0
        self.generator = torch.Generator().manual_seed(seed)

    def train(self, exp: Experience) -> dict[str, float]:
        """One PPO update on ``exp``: recompute π_old, run the epochs, advance the policy version."""
        exp = exp.to(self.actor.device)
        batch = self._prepare(exp)
        means = self._run_epochs(exp, batch)
        kl_per_sequence = (exp.kl * batch.mask).sum(dim=1)
        self.kl_controller.update(float(kl_per_sequence.mean()), len(batch.mask))
        self.version += 1
        return {**means, **self._batch_statistics(exp, batch, kl_per_sequence)}

    # ------------------------------------------------------------------ the steps of one update

    def _prepare(self, exp: Experience) -> _Batch:
        """Pack the sequences, whiten the advantages, recompute π_old and the importance weights of stale data."""
        mask = exp.mask
        packed = pack(
            exp.prompt_tokens, exp.prompt_lengths, exp.response_tokens, exp.response_lengths, self.pad_token_id
        )
        micro = self.cfg.micro_batch_size or self.cfg.mini_batch_size
        advantages = ppo.masked_whiten(exp.advantages, mask) if self.algo.whiten_advantages else exp.advantages
        # π_old is the learner's own policy now: the sampler's log-probs differ (other kernels, other engine).
        with torch.no_grad():
            old_logp = (
                torch.cat(
                    [
                        response_logprobs(self.actor, packed.rows(i), exp.response_tokens[i], self.temperature)[0]
                        for i in _chunks(torch.arange(len(mask)), micro)
                    ]
                )
                * mask
            )
        staleness = self.version - exp.policy_version
        importance = None
        if self.cfg.off_policy_correction and staleness > 0:
            importance = ppo.truncated_importance_weights(old_logp, exp.behaviour_logprobs, self.cfg.importance_cap)
        return _Batch(packed, mask, advantages, old_logp, importance, staleness, micro)

    def _run_epochs(self, exp: Experience, batch: _Batch) -> dict[str, float]:
        """``ppo_epochs`` passes over shuffled mini-batches, one optimizer step each; the statistics' means."""
        sums: dict[str, float] = {}

        def add(**values):
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + float(value)

        steps = 0
        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(len(batch.mask), generator=self.generator)
            for mini in _chunks(order, self.cfg.mini_batch_size):
                self._mini_batch_step(exp, batch, mini, add)
                steps += 1
        return {key: value / steps for key, value in sums.items()}

    def _mini_batch_step(self, exp: Experience, batch: _Batch, mini: torch.Tensor, add) -> None:
        """Accumulate the gradients of the mini-batch's micro-batches, then step actor and critic; statistics go
        to ``add(name=value, ...)``."""
        cfg = self.cfg
        num_tokens = float(batch.mask[mini].sum())
        self.actor_optimizer.zero_grad(set_to_none=True)
        self.critic_optimizer.zero_grad(set_to_none=True)
        for rows in _chunks(mini, batch.micro):
            # token-mean divides by the mini-batch's tokens; the other modes average sequences.
            scale = 1.0 if cfg.loss_agg == "token-mean" else len(rows) / len(mini)
            m = batch.mask[rows]
            logp, entropy = response_logprobs(
                self.actor, batch.packed.rows(rows), exp.response_tokens[rows], self.temperature, with_entropy=True
            )
            pg_loss, pg_stats = ppo.policy_loss(
                logp,
                batch.old_logp[rows],
                batch.advantages[rows],
                m,
                cfg.clip_low,
                cfg.clip_high,
                cfg.dual_clip,
                batch.importance[rows] if batch.importance is not None else None,
                cfg.loss_agg,
                num_tokens,
            )
            entropy_loss = ppo.agg_loss(entropy, m, cfg.loss_agg, num_tokens)
            ((pg_loss - cfg.entropy_coef * entropy_loss) * scale).backward()
            values = response_values(self.critic, batch.packed.rows(rows))
            vf_loss, vf_stats = ppo.value_loss(
                values, exp.values[rows], exp.returns[rows], m, cfg.value_clip, cfg.loss_agg, num_tokens
            )
            (cfg.value_coef * vf_loss * scale).backward()
            # Each statistic is averaged over the mini-batch's rows, then over the optimizer steps.
            share = len(rows) / len(mini)
            add(
                policy_loss=pg_loss.detach() * scale,
                value_loss=vf_loss.detach() * scale,
                entropy=ppo.masked_mean(entropy.detach(), m) * share,
                clip_frac=pg_stats.clip_frac * share,
                approx_kl=pg_stats.approx_kl * share,
                dual_clip_frac=pg_stats.dual_clip_frac * share,
                value_clip_frac=vf_stats.clip_frac * share,
            )
        add(
            grad_norm_actor=self._step(self.actor, self.actor_optimizer),
            grad_norm_critic=self._step(self.critic, self.critic_optimizer),
        )

    def _batch_statistics(self, exp: Experience, batch: _Batch, kl_per_sequence: torch.Tensor) -> dict[str, float]:
        """What the experience itself says: reward, KL, critic fit, lengths, the sampler/learner log-prob gap."""
        mask, n = batch.mask, len(batch.mask)
        return {
            "reward_mean": float(exp.scores.mean()),
            "reward_std": float(exp.scores.std()) if n > 1 else 0.0,
            "kl": float(ppo.masked_mean(exp.kl, mask)),
            "kl_per_sequence": float(kl_per_sequence.mean()),
            "kl_coef": self.kl_controller.value,
            "explained_variance": float(ppo.explained_variance(exp.values, exp.returns, mask)),
            "advantage_mean": float(ppo.masked_mean(exp.advantages, mask)),
            "response_length": float(exp.response_lengths.float().mean()),
            "finished_frac": float(exp.finished.float().mean()),
            "logprob_mismatch": float(ppo.masked_mean((batch.old_logp - exp.behaviour_logprobs).abs(), mask)),
            "staleness": float(batch.staleness),
            "policy_version": float(self.version),
        }

    def state_dict(self) -> dict:
        """Everything needed to continue training exactly: weights, optimizers, KL controller, version, RNG."""
        return {
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict(),
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "version": self.version,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.version = int(state["version"])
        self.generator.set_state(state["generator"])

    def _step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if torch.isfinite(norm):
            optimizer.step()
        # A non-finite gradient skips the step rather than poisoning the weights; the norm is reported.
        return float(norm)
