"""The learner's core: PPO epochs over one batch of experience, for the actor and the critic.

It owns the trainable actor and critic (none with a critic-free estimator), their optimizers, the KL controller and
the policy version. No I/O:
the learner service decodes experience into :class:`Experience`, calls :meth:`PPOTrainer.train`, and publishes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from common import ppo
from common.algorithms import POLICY_LOSSES
from common.config import AlgorithmSection, LearnerSection
from common.schema import ExperienceBatch
from common.sequences import (
    PackedSequences,
    lengths_to_mask,
    micro_batches,
    microbatch_view,
    pack,
    pad_columns,
    response_logprobs,
    response_values,
)
from common.storage import fsync_file
from common.weights import (
    first_names,
    is_adapted,
    load_state_into,
    part_name,
    plan_parts,
    published_tensors,
    write_part,
)
from services.learner.parallel import Ranks, gather_full_state, lead

__all__ = ["Experience", "PPOTrainer"]


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


def _across_versions(exp: Experience, mask: torch.Tensor) -> torch.Tensor:
    """``(N,)`` whether more than one version sampled the tokens of each sequence."""
    if exp.token_versions is None:
        return torch.zeros(exp.rows, dtype=torch.bool)
    newest = torch.where(mask.bool(), exp.token_versions, exp.policy_versions.unsqueeze(-1)).amax(-1)
    return newest > exp.policy_versions


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that train: all of them, or a LoRA model's adapters."""
    return [p for p in model.parameters() if p.requires_grad]


def _chunks(index: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [index[i : i + size] for i in range(0, len(index), size)]


@dataclass(frozen=True)
class _Batch:
    """One experience batch made ready for the epochs: ``N`` sequences, responses of length ``T``."""

    packed: PackedSequences  # prompt + response, left-aligned, for the forward passes
    mask: torch.Tensor  # (N, T) 1.0 at response tokens
    advantages: torch.Tensor  # (N, T) whitened if configured
    old_logp: torch.Tensor  # (N, T) log π_old, recomputed by the learner before the first step
    importance: torch.Tensor  # (N, T) the off-policy correction's weights (1 where none applies)
    staleness: torch.Tensor  # (N,) learner version − the version that sampled each sequence (< 0: rolled back)
    correction: dict[str, float]  # what the off-policy correction did, for the update's statistics


@dataclass(frozen=True)
class _Pass:
    """One forward/backward pass of a rank: its rows, and 1.0, or 0.0 for a pass a rank runs only to keep in step
    with ranks that have more passes (sharded modules gather their parameters in every rank's forward)."""

    rows: torch.Tensor
    weight: float


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
        return {**means, **self._batch_statistics(exp, batch, kl_per_sequence), "lr_factor": rate}

    def _set_learning_rates(self) -> float:
        """Each optimizer's rate for the update this version makes: a function of the version alone, so a learner
        back from its checkpoint continues the schedule where it was."""
        rate = lr_factor(
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

    def _prepare(self, exp: Experience) -> _Batch:
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
        return _Batch(packed, mask, advantages, old_logp, importance, staleness, statistics)

    def _run_epochs(self, exp: Experience, batch: _Batch) -> dict[str, float]:
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

    def _mini_batch_step(self, exp: Experience, batch: _Batch, mini: torch.Tensor, add) -> dict[str, float]:
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

    def _batch_statistics(self, exp: Experience, batch: _Batch, kl_per_sequence: torch.Tensor) -> dict[str, float]:
        """What the experience itself says: reward, KL, critic fit, lengths, the sampler/learner log-prob gap."""
        mask, n = batch.mask, len(batch.mask)
        gap = (batch.old_logp - exp.behaviour_logprobs).abs()  # the sampler's log-probs against the learner's
        return {
            "reward_mean": float(exp.scores.mean()),
            "reward_std": float(exp.scores.std()) if n > 1 else 0.0,
            "kl": float(ppo.masked_mean(exp.kl, mask)),
            "kl_per_sequence": float(kl_per_sequence.mean()),
            "kl_coef": self.kl_controller.value,
            **(
                {"explained_variance": float(ppo.explained_variance(exp.values, exp.returns, mask))}
                if self.critic is not None
                else {}
            ),
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
            "policy_version": float(self.version),
        }

    # ------------------------------------------------------------------ state: checkpoints, snapshots, answers

    def state_dict(self) -> dict:
        """Everything needed to continue training exactly: weights, optimizers, KL controller, version, RNG.
        Single process only; sharded trainers checkpoint with :meth:`save`."""
        state = self._small_state()
        for name, model, optimizer in self.models():
            # What trains: a LoRA actor's adapters alone (the base weights are the configured model's).
            weights = published_tensors(model) if is_adapted(model) else model.state_dict()
            state[name], state[f"{name}_optimizer"] = weights, optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        missing = [name for name, _, _ in self.models() if name not in state]
        if missing:
            raise RuntimeError(f"the checkpoint holds no {', '.join(missing)}: it was written with another estimator")
        for name, model, optimizer in self.models():
            if is_adapted(model):
                load_state_into(model, state[name], f"checkpoint {name}")
            else:
                model.load_state_dict(state[name])
            optimizer.load_state_dict(state[f"{name}_optimizer"])
        self._load_small_state(state)

    def _small_state(self) -> dict:
        return {
            "kl_controller": self.kl_controller.state_dict(),
            "version": self.version,
            "generator": self.generator.get_state(),
        }

    def _load_small_state(self, state: dict) -> None:
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.version = int(state["version"])
        self.generator.set_state(state["generator"])

    @lead
    def save(self, folder: Path) -> None:
        """Write the trainer's state into ``folder`` (which exists). Sharded: every rank writes its shards with
        torch.distributed.checkpoint under ``folder/shards`` (re-shardable to any number of ranks), rank 0 the
        rest; single: one ``trainer.pt``."""
        folder = Path(folder)
        if not self.ranks.sharded:
            torch.save(self.state_dict(), folder / "trainer.pt")
            fsync_file(folder / "trainer.pt")
            return
        import torch.distributed.checkpoint as dcp

        dcp.save(self._sharded_state(), checkpoint_id=folder / "shards")
        if self.ranks.leads:
            torch.save(self._small_state(), folder / "trainer.pt")
            fsync_file(folder / "trainer.pt")

    @lead
    def load(self, folder: Path) -> None:
        """Restore what :meth:`save` wrote, with any number of ranks (a sharded checkpoint is re-sharded)."""
        folder = Path(folder)
        sharded_checkpoint = (folder / "shards").is_dir()
        if sharded_checkpoint != self.ranks.sharded:
            raise RuntimeError(
                f"checkpoint {folder} was written by a {'sharded' if sharded_checkpoint else 'single-process'} "
                f"learner; this one is {'sharded' if self.ranks.sharded else 'single-process'}. Resume it with the "
                "learner.parallel.strategy that wrote it"
            )
        state = torch.load(folder / "trainer.pt", weights_only=True)
        if not self.ranks.sharded:
            self.load_state_dict(state)
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sharded = self._sharded_state()
        dcp.load(sharded, checkpoint_id=folder / "shards")
        for name, model, optimizer in self.models():
            set_state_dict(
                model,
                optimizer,
                model_state_dict=sharded[name],
                optim_state_dict=sharded[f"{name}_optimizer"],
            )
        self._load_small_state(state)

    def checkpoint_nbytes(self) -> int:
        """What :meth:`save` writes on this rank, about: weights and two Adam moments of its trained parameters."""
        local = [getattr(p, "to_local", lambda p=p: p)() for _, m, _ in self.models() for p in _trainable(m)]
        return sum(3 * t.numel() * t.element_size() for t in local)

    def models(self) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer]]:
        """What trains: the actor, and the critic when the estimator uses one."""
        models = [("actor", self.actor, self.actor_optimizer)]
        if self.critic is not None:
            models.append(("critic", self.critic, self.critic_optimizer))
        return models

    def _module(self, model: str) -> torch.nn.Module:
        return {name: module for name, module, _ in self.models()}[model]

    def _sharded_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        state = {}
        for name, model, optimizer in self.models():
            state[name], state[f"{name}_optimizer"] = get_state_dict(model, optimizer)
        return state

    @lead
    def full_state(self, model: str, dtype: str = "float32") -> dict[str, torch.Tensor] | None:
        """The whole ``actor`` or ``critic`` state in ``dtype`` on rank 0's CPU (None on the other ranks), each
        tied tensor once, under its first name (as a transformers checkpoint has it)."""
        module = self._module(model)
        target = getattr(torch, dtype)
        if is_adapted(module):  # one process (config): the adapters are the snapshot
            return {name: t.detach().cpu().to(target).contiguous() for name, t in published_tensors(module).items()}
        state = gather_full_state(module, self.ranks)
        if state is None:
            return None
        return {
            name: (tensor.to(target) if tensor.is_floating_point() else tensor).contiguous()
            for name, tensor in state.items()
            if name in first_names(module)
        }

    @lead
    def write_snapshot_parts(self, model: str, dtype: str, folder: str, digest: str) -> list | None:
        """Every rank writes its part of a sharded snapshot of ``model`` into ``folder`` (in parallel); rank 0
        returns ``[(file name, digest, {tensor: shape}), ...]`` of all parts (None on the others).

        Tensors are dealt to the ranks by :func:`common.weights.plan_parts`, the same way on every rank. Each is
        gathered whole (``full_tensor``, a collective every rank joins, in one order) and
        kept by its owner only: the traffic of gathering the state to rank 0, and no rank holds more than its part
        plus the one tensor in flight.
        """
        module = self._module(model)
        state = module.state_dict()
        names = sorted(first_names(module))  # one order on every rank
        world, rank = self.ranks.world_size, self.ranks.rank
        owner = plan_parts({n: state[n].numel() * state[n].element_size() for n in names}, world)
        target, mine = getattr(torch, dtype), {}
        for name in names:
            tensor = state[name]
            whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if owner[name] == rank:
                whole = whole.detach().cpu()
                mine[name] = (whole.to(target) if whole.is_floating_point() else whole).contiguous()
        part = part_name(rank, world)
        written = (part, write_part(folder, part, mine, digest), {n: tuple(t.shape) for n, t in mine.items()})
        return self.ranks.gather(written)

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
