"""The learner's core: PPO epochs over one batch of experience, for the actor and the critic.

It owns the trainable actor and critic (none with a critic-free estimator), their optimizers, the KL controller and
the policy version. No I/O: the learner service decodes experience into :class:`~.experience.Experience`, calls
:meth:`PPOTrainer.train`, and publishes; what a checkpoint and a snapshot take of the trainer is written by
:mod:`.checkpoints` and :mod:`.snapshots`, behind the trainer's thin ``@lead`` methods (every rank runs them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common import ppo
from common.algorithms import POLICY_LOSSES
from common.config import AlgorithmSection, LearnerSection
from common.sequences import (
    PackedSequences,
    micro_batches,
    microbatch_view,
    pack,
    pad_columns,
    response_logprobs,
    response_values,
)
from services.learner.checkpoints import load_trainer, load_trainer_state, save_trainer, trainer_state
from services.learner.experience import Experience, PreparedBatch, experience_statistics
from services.learner.parallel import Ranks, lead
from services.learner.snapshots import full_state, write_parts

__all__ = ["PPOTrainer"]


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that train: all of them, or a LoRA model's adapters."""
    return [p for p in model.parameters() if p.requires_grad]


def _chunks(index: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [index[i : i + size] for i in range(0, len(index), size)]


@dataclass(frozen=True)
class _Pass:
    """One forward/backward pass of a rank: its rows, and 1.0, or 0.0 for a pass a rank runs only to keep in step
    with ranks that have more passes (sharded modules gather their parameters in every rank's forward)."""

    rows: torch.Tensor
    weight: float


class PPOTrainer:
    def __init__(
        self,
        actor: torch.nn.Module,
        critic: torch.nn.Module | None,
        learner: LearnerSection,
        algorithm: AlgorithmSection,
        temperature: float,
        pad_token_id: int,
        seed: int = 0,
        ranks: Ranks | None = None,
        max_response_length: int | None = None,
        total_updates: int | None = None,
    ):
        """``actor`` and ``critic`` come sharded already when ``ranks.sharded`` (:func:`.parallel.shard_model`): the
        optimizers must see the sharded parameters. ``critic`` is None with a critic-free estimator.
        ``max_response_length`` (the sampler's limit) normalises the ``seq-mean-token-sum-norm`` loss;
        ``total_updates`` (``run.steps``) is where the learning-rate schedule ends."""
        if (critic is None) == algorithm.uses_critic:
            raise ValueError(
                f"estimator {algorithm.estimator} {'needs' if algorithm.uses_critic else 'takes no'} critic"
            )
        self.actor, self.critic = actor, critic
        self.ranks = ranks or Ranks()
        self.cfg, self.algo = learner, algorithm
        self.temperature, self.pad_token_id = temperature, pad_token_id
        self.max_response_length = max_response_length
        self.total_updates = total_updates
        self.actor_optimizer = torch.optim.AdamW(
            _trainable(actor), lr=learner.actor_lr, weight_decay=learner.weight_decay
        )
        self.critic_optimizer = (
            torch.optim.AdamW(_trainable(critic), lr=learner.critic_lr, weight_decay=learner.weight_decay)
            if critic is not None
            else None
        )
        if algorithm.adaptive_kl is not None:
            self.kl_controller = ppo.AdaptiveKLController(
                algorithm.kl_coef, algorithm.adaptive_kl.target, algorithm.adaptive_kl.horizon
            )
        else:
            self.kl_controller = ppo.FixedKLController(algorithm.kl_coef)
        self.policy_loss = ppo.POLICY_LOSSES[learner.policy_loss]
        self.version = 0
        self.generator = torch.Generator().manual_seed(seed)

    @lead
    def train(self, exp: Experience) -> dict[str, float]:
        """One PPO update on ``exp``: recompute π_old, run the epochs, advance the policy version.

        With several ranks every rank holds all of ``exp`` and trains on its share of each mini-batch; losses are
        normalised by the whole mini-batch, so the update is the one a single process would make.
        """
        exp = exp.to(self.ranks.device)
        rate = self._set_learning_rates()
        batch = self._prepare(exp)
        means = self._run_epochs(exp, batch)
        kl_per_sequence = (exp.kl * batch.mask).sum(dim=1)
        self.kl_controller.update(float(kl_per_sequence.mean()), len(batch.mask))
        self.version += 1
        critic, kl_coef = self.critic is not None, self.kl_controller.value
        statistics = experience_statistics(exp, batch, kl_per_sequence, kl_coef, critic, self.version)
        return {**means, **statistics, "lr_factor": rate}

    def _set_learning_rates(self) -> float:
        """Each optimizer's rate for the update this version makes: a function of the version alone, so a learner
        back from its checkpoint continues the schedule where it was."""
        rate = ppo.lr_factor(
            self.version,
            self.total_updates or self.version + 1,
            self.cfg.lr_schedule,
            self.cfg.lr_warmup_updates,
            self.cfg.lr_min_ratio,
        )
        for optimizer, base in ((self.actor_optimizer, self.cfg.actor_lr), (self.critic_optimizer, self.cfg.critic_lr)):
            for group in optimizer.param_groups if optimizer is not None else ():
                group["lr"] = base * rate
        return rate

    # ------------------------------------------------------------------ the steps of one update

    def _prepare(self, exp: Experience) -> PreparedBatch:
        """Pack the sequences, whiten the advantages, recompute π_old and the importance weights (off-policy tokens)."""
        mask = exp.mask
        packed = pack(
            exp.prompt_tokens, exp.prompt_lengths, exp.response_tokens, exp.response_lengths, self.pad_token_id
        )
        advantages = ppo.masked_whiten(exp.advantages, mask) if self.algo.whitens else exp.advantages
        # π_old is the learner's own policy now: the sampler's log-probs differ (other kernels, other engine).
        # Each rank computes its share of the rows; the sum over ranks (zeros elsewhere) is every row's.
        old_logp = torch.zeros_like(mask)
        with torch.no_grad():
            for step in self._passes(exp, torch.arange(len(mask))):
                view = self._view(exp, packed, step.rows)
                tokens = exp.response_tokens[step.rows, : view.response_width]
                logp = response_logprobs(self.actor, view, tokens, self.temperature)[0]  # as π_θ in the loss
                if step.weight:
                    old_logp[step.rows] = pad_columns(logp, mask.shape[1])
        old_logp = self.ranks.all_reduce_sum(old_logp) * mask
        staleness = self.version - exp.policy_versions
        versions = exp.token_versions if exp.token_versions is not None else exp.policy_versions.unsqueeze(-1)
        # Tokens sampled by another version than π_old's: older, or (below zero staleness) one a crash rolled back.
        correction = self.cfg.off_policy
        corrected = {
            "none": torch.zeros_like(mask, dtype=torch.bool),
            "stale": (versions != self.version) & mask.bool(),
            "all": mask.bool(),
        }[correction.applies_to]
        importance, stats = ppo.off_policy_weights(
            old_logp,
            exp.behaviour_logprobs,
            corrected,
            correction.token_cap,
            correction.token_band,
            correction.sequence_band,
            correction.geometric_band,
        )
        statistics = {
            "off_policy_tokens": float(corrected.sum() / mask.sum().clamp(min=1)),
            "off_policy_masked": float(stats.masked_tokens),
            "off_policy_masked_sequences": float(stats.masked_sequences),
            "off_policy_weight": float(stats.weight_mean),
        }
        return PreparedBatch(packed, mask, advantages, old_logp, importance, staleness, statistics)

    def _run_epochs(self, exp: Experience, batch: PreparedBatch) -> dict[str, float]:
        """``ppo_epochs`` passes over shuffled mini-batches, one optimizer step each; the statistics' means."""
        sums: dict[str, float] = {}

        def add(**values):
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + float(value)

        steps, norms = 0, {f"grad_norm_{name}": 0.0 for name, _, _ in self.models()}
        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(len(batch.mask), generator=self.generator)
            for mini in _chunks(order, self.cfg.mini_batch_size):
                for name, norm in self._mini_batch_step(exp, batch, mini, add).items():
                    norms[f"grad_norm_{name}"] += norm
                steps += 1
        # Each rank summed the statistics of its rows; the norms are global already.
        keys = sorted(sums)
        totals = self.ranks.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
        return {key: value / steps for key, value in {**dict(zip(keys, totals.tolist())), **norms}.items()}

    def _passes(self, exp: Experience, rows: torch.Tensor) -> list[_Pass]:
        """This rank's forward passes over ``rows``: its share of them (every ``world_size``-th row by length, so
        that ranks get alike lengths), cut by ``micro_batch_size`` or by the token budget; then padded with passes
        of weight 0 to the most passes any rank has."""
        cfg, ranks = self.cfg, self.ranks
        if ranks.world_size > 1:
            lengths = (exp.prompt_lengths + exp.response_lengths)[rows]
            rows = rows[torch.argsort(lengths, descending=True, stable=True)][ranks.rank :: ranks.world_size]
        groups = micro_batches(
            exp.prompt_lengths,
            exp.response_lengths,
            rows,
            cfg.max_tokens_per_microbatch,
            cfg.micro_batch_size or cfg.mini_batch_size,
        )
        passes = [_Pass(group, 1.0) for group in groups if len(group)]
        filler = rows[:1] if len(rows) else torch.zeros(1, dtype=torch.long)
        passes += [_Pass(filler, 0.0)] * (ranks.all_reduce_max(len(passes)) - len(passes))
        return passes

    def _view(self, exp: Experience, packed: PackedSequences, rows: torch.Tensor) -> PackedSequences:
        if self.cfg.max_tokens_per_microbatch is None:
            return packed.rows(rows)
        return microbatch_view(packed, exp.prompt_lengths, exp.response_lengths, rows)

    def _mini_batch_step(self, exp: Experience, batch: PreparedBatch, mini: torch.Tensor, add) -> dict[str, float]:
        """Accumulate the gradients of this rank's passes over the mini-batch, then step actor and critic;
        statistics (this rank's part of the mini-batch's) go to ``add(name=value, ...)``; returns the gradient
        norms by model."""
        cfg = self.cfg
        num_tokens = float(batch.mask[mini].sum())
        agg = {"agg": cfg.loss_agg, "num_tokens": num_tokens, "norm_length": self.max_response_length}

        def aggregate(losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return ppo.agg_loss(losses, mask, cfg.loss_agg, num_tokens, self.max_response_length)

        # Sharded gradients are averaged over the ranks; each rank's loss is its rows' part of the whole
        # mini-batch's, so the sum is wanted.
        world = self.ranks.world_size
        for _, _, optimizer in self.models():
            optimizer.zero_grad(set_to_none=True)
        for step in self._passes(exp, mini):
            rows = step.rows
            view = self._view(exp, batch.packed, rows)
            width = view.response_width
            # token-mean divides by the mini-batch's tokens; the other modes average sequences.
            scale = step.weight * (1.0 if cfg.loss_agg == "token-mean" else len(rows) / len(mini))
            m = batch.mask[rows, :width]
            logp, entropy = response_logprobs(
                self.actor, view, exp.response_tokens[rows, :width], self.temperature, with_entropy=True
            )
            pg_loss, pg_stats = self.policy_loss(
                logp,
                batch.old_logp[rows, :width],
                batch.advantages[rows, :width],
                m,
                importance_weights=batch.importance[rows, :width],
                **agg,
                **POLICY_LOSSES.settings(cfg),
            )
            loss = pg_loss - cfg.entropy_coef * aggregate(entropy, m)
            # Token statistics are means over the mini-batch's tokens (so the same however its rows are split over
            # passes and ranks), then over the optimizer steps.
            share = step.weight * float(m.sum()) / max(num_tokens, 1.0)
            if self.algo.kl_in == "loss":
                kl = ppo.kl_estimate(logp, exp.ref_logprobs[rows, :width], self.algo.kl_estimator)
                kl_loss = aggregate(kl, m)
                loss = loss + self.kl_controller.value * kl_loss
                add(kl_loss=kl_loss.detach() * scale)
            (loss * scale * world).backward()
            add(
                policy_loss=pg_loss.detach() * scale,
                entropy=ppo.masked_mean(entropy.detach(), m) * share,
                clip_frac=pg_stats.clip_frac * share,
                approx_kl=pg_stats.approx_kl * share,
                dual_clip_frac=pg_stats.dual_clip_frac * share,
            )
            if self.critic is not None:
                values = response_values(self.critic, view)
                vf_loss, vf_stats = ppo.value_loss(
                    values, exp.values[rows, :width], exp.returns[rows, :width], m, cfg.value_clip, **agg
                )
                (cfg.value_coef * vf_loss * scale * world).backward()
                add(value_loss=vf_loss.detach() * scale, value_clip_frac=vf_stats.clip_frac * share)
        return {name: self._step(model, optimizer) for name, model, optimizer in self.models()}

    # ------------------------------------------------------------------ state: checkpoints, snapshots, answers
    # The @lead methods every rank runs (followers dispatch by name): thin, their work in .checkpoints and .snapshots.

    def state_dict(self) -> dict:
        """The whole training state, single process (:func:`~services.learner.checkpoints.trainer_state`)."""
        return trainer_state(self)

    def load_state_dict(self, state: dict) -> None:
        load_trainer_state(self, state)

    @lead
    def save(self, folder: Path) -> None:
        """Write the trainer's state into ``folder`` (:func:`~services.learner.checkpoints.save_trainer`)."""
        save_trainer(self, Path(folder))

    @lead
    def load(self, folder: Path) -> None:
        """Restore what :meth:`save` wrote (:func:`~services.learner.checkpoints.load_trainer`)."""
        load_trainer(self, Path(folder))

    def models(self) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
        """What trains: the actor, and the critic when the estimator uses one."""
        models = [("actor", self.actor, self.actor_optimizer)]
        if self.critic is not None:
            models.append(("critic", self.critic, self.critic_optimizer))
        return models

    def module(self, model: str) -> torch.nn.Module:
        return {name: module for name, module, _ in self.models()}[model]

    @lead
    def full_state(self, model: str, dtype: str = "float32") -> dict[str, torch.Tensor] | None:
        """The whole state of ``model`` on rank 0's CPU (:func:`~services.learner.snapshots.full_state`)."""
        return full_state(self.module(model), self.ranks, dtype)

    @lead
    def write_snapshot_parts(self, model: str, dtype: str, folder: str, digest: str) -> list | None:
        """Every rank's part of a sharded snapshot (:func:`~services.learner.snapshots.write_parts`)."""
        return write_parts(self.module(model), self.ranks, dtype, folder, digest)

    @lead
    def answer(self, fn, *args):
        """``fn(actor, *args)`` on every rank (a sharded actor can only run forward passes on all of them at once);
        ``fn`` must be a module-level function, as it travels by name to the other ranks."""
        return fn(self.actor, *args)

    def release(self) -> None:
        """Every rank, when it is done with the trainer: the followers stop following, the ranks part."""
        self.ranks.release()

    def _step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # sharded: the norm over every rank
        if torch.isfinite(norm):
            optimizer.step()
        # A non-finite gradient skips the step rather than poisoning the weights; the norm is reported.
        return float(norm)
