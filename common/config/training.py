"""The sections of what the learner does: the algorithm (estimator, KL, losses: the declared variants of
:mod:`common.algorithms`), the learner (its batches, ranks and off-policy corrections), and evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from common.algorithms import (
    ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    Kind,
)
from common.config.base import Section


class AdaptiveKL(Section):
    target: float = Field(6.0, gt=0, description="Target KL per sequence (sum over tokens).")
    horizon: int = Field(10000, gt=0, description="Sequences over which β moves by at most 20%.")


def _declared(kind: Kind):
    """A setting that names a declared variant of ``kind`` (:mod:`common.algorithms`), described by the declarations."""
    return Annotated[str, AfterValidator(kind.check)]


class AlgorithmSection(Section):
    estimator: _declared(ESTIMATORS) = Field("gae", description=ESTIMATORS.describe())
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of later token rewards (1: none, the LLM default).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ (gae only).")
    kl_estimator: _declared(KL_ESTIMATORS) = Field("k1", description=KL_ESTIMATORS.describe())
    kl_coef: float = Field(0.05, ge=0, description="β of the KL penalty (initial β if adaptive).")
    kl_in: Literal["reward", "loss"] = Field(
        "reward",
        description="reward: −β·KL in every token's reward (PPO-RLHF); loss: β·KL(π‖π_ref) added to the policy loss "
        "with kl_estimator (k3 as in GRPO), the rewards carrying the score alone.",
    )
    adaptive_kl: AdaptiveKL | None = None
    whiten_advantages: bool = Field(
        True, description="Whiten GAE advantages over each batch (gae only: the other estimators normalise their own)."
    )

    @property
    def uses_critic(self) -> bool:
        return ESTIMATORS.chosen(self).uses_critic

    @property
    def whitens(self) -> bool:
        """Whether the learner whitens the advantages it receives."""
        return self.uses_critic and self.whiten_advantages

    score_clip: float | None = Field(None, gt=0, description="Scores clipped to [-score_clip, score_clip]; none: not.")
    missing_eos_penalty: float | None = Field(None, description="Subtracted from the score of truncated responses.")
    overlong_buffer: int | None = Field(
        None,
        gt=0,
        description="DAPO's overlong shaping: a response longer than generation.max_new_tokens − overlong_buffer "
        "tokens loses overlong_penalty × (its excess / overlong_buffer) of its score, the whole penalty at the limit.",
    )
    overlong_penalty: float = Field(1.0, gt=0, description="With overlong_buffer: the penalty at the length limit.")
    dynamic_sampling: bool = Field(
        False,
        description="Drop groups whose scores are all equal (zero advantage: they teach nothing) at the advantage "
        "stage, and keep sampling until every update has learner.groups_per_update informative groups (DAPO). Needs "
        "a group estimator.",
    )
    max_sampling_factor: float = Field(
        3.0,
        ge=1,
        description="With dynamic_sampling: at most this many times the groups the updates need are sampled (the "
        "feeder publishes that many prompt batches); a run that uses them all ends early and says so.",
    )


class ParallelOptions(Section):
    """How the learner spreads over devices."""

    strategy: Literal["single", "fsdp"] = Field(
        "single", description="single: one process; fsdp: actor and critic sharded with torch's FSDP2."
    )
    processes: int = Field(
        1,
        gt=0,
        description="Ranks on this machine. With more than 1, `streamppo learner` starts them itself through "
        "torch's launcher; across machines run it under torchrun (README).",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Times in a row `streamppo learner` restarts all ranks after one dies, before it exits with an "
        "error (for its supervisor).",
    )

    @model_validator(mode="after")
    def _processes_need_a_strategy(self):
        if self.processes > 1 and self.strategy == "single":
            raise ValueError("processes > 1 needs strategy: fsdp")
        return self


Band = tuple[Annotated[float, Field(gt=0)], Annotated[float, Field(gt=0)]]


class OffPolicy(Section):
    """How the learner corrects for tokens sampled by another policy than π_old (``common.ppo.off_policy_weights``),
    from ``r = π_old / π_behaviour``."""

    applies_to: Literal["none", "stale", "all"] = Field(
        "stale",
        description="stale: tokens sampled by another version than π_old's; all: every token, as the sampler's "
        "numerics never match the learner's; none: no correction.",
    )
    token_cap: float | None = Field(2.0, ge=1, description="Truncated importance weight min(r, token_cap); null: 1.")
    token_band: Band | None = Field(None, description="[lo, hi]: a token whose r is outside gets weight 0 (IcePop).")
    sequence_band: Band | None = Field(
        None, description="[lo, hi]: a response whose product of r is outside gets weight 0 on every token."
    )
    geometric_band: Band | None = Field(
        None, description="[lo, hi]: a response whose geometric mean of r is outside gets weight 0 on every token."
    )

    @model_validator(mode="after")
    def _bands_are_ordered(self):
        for name in ("token_band", "sequence_band", "geometric_band"):
            band = getattr(self, name)
            if band is not None and not band[0] < 1.0 < band[1]:
                raise ValueError(f"{name} {list(band)} must hold 1 strictly inside: [lo < 1 < hi]")
        return self


class LearnerSection(Section):
    groups_per_update: int | None = Field(
        None,
        gt=0,
        description="Groups (a prompt's n responses) one update trains on, taken as they arrive, oldest version "
        "first; default: data.batch_size (one prompt batch per update).",
    )
    ppo_epochs: int = Field(2, gt=0, description="Passes over each update's experience.")
    mini_batch_size: int = Field(
        16,
        gt=0,
        description="Sequences per optimizer step. Left unset, at most the responses per update (a smaller batch "
        "is then one mini-batch).",
    )
    micro_batch_size: int | None = Field(None, gt=0, description="Sequences per forward pass; default: the mini-batch.")
    actor_lr: float = Field(1e-5, gt=0, description="The actor's learning rate (AdamW).")
    critic_lr: float = Field(1e-5, gt=0, description="The critic's learning rate (AdamW).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="The learning rates over the run's updates (run.steps), set at each update: constant; linear "
        "to lr_min_ratio × lr at the last update (TRL's default, per optimizer step there); cosine down to it.",
    )
    lr_warmup_updates: int = Field(0, ge=0, description="Updates over which the rates rise linearly to their value.")
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="Where linear and cosine end, as a share of the rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's weight decay, both models.")
    clip_low: float = Field(0.2, gt=0, lt=1, description="ε_low of the ratio clip.")
    clip_high: float = Field(0.2, gt=0, description="ε_high of the ratio clip.")
    dual_clip: float | None = Field(
        None, gt=1, description="Dual clip: the loss of a negative advantage at most c·|A|."
    )
    gspo_clip_low: float = Field(3e-4, gt=0, lt=1, description="ε_low of GSPO's clip of a response's ratio.")
    gspo_clip_high: float = Field(4e-4, gt=0, description="ε_high of GSPO's clip of a response's ratio.")
    value_clip: float | None = Field(0.2, gt=0, description="ε_v: the value loss clips V to V_old ± this; none: not.")
    value_coef: float = Field(1.0, gt=0, description="Scale of the critic's loss (it has its own optimizer).")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus in the policy loss.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradients clipped to this norm; none: not clipped.")
    policy_loss: _declared(POLICY_LOSSES) = Field("ppo", description=POLICY_LOSSES.describe())
    loss_agg: _declared(LOSS_AGGREGATIONS) = Field(
        "token-mean", description="How per-token losses add up: " + LOSS_AGGREGATIONS.describe()
    )
    off_policy: OffPolicy = OffPolicy()
    checkpoint_dir: Path | None = Field(None, description="Default: <run.dir>/checkpoints.")
    checkpoint_every: int = Field(
        1,
        gt=0,
        description="Updates between checkpoints (and on shutdown). Input is "
        "committed at checkpoints only; a crash re-applies the updates since the last one.",
    )
    max_tokens_per_microbatch: int | None = Field(
        None,
        gt=0,
        description="Token budget of one forward/backward pass: each rank's rows of a mini-batch, sorted by "
        "length, grouped while rows × longest row fits (a row longer than the budget goes alone). Replaces "
        "micro_batch_size; the update is the same, within float rounding.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass: less memory, ~1/3 more compute.",
    )
    parallel: ParallelOptions = ParallelOptions()


class EvalSection(Section):
    """Evaluation while the run trains, off the learner's path: the evaluator role (``services/evaluator/``) follows
    the actor's announcements and scores held-out prompts with the run's reward every ``every`` versions."""

    prompts: Path = Field(
        description="Held-out prompts, JSONL as data.prompts (a label per row for rewards that read one); relative to "
        "the config's folder. Never trained on."
    )
    every: int = Field(5, gt=0, description="Evaluate actor versions 0, every, 2·every, ... and the run's last.")
    max_prompts: int = Field(64, gt=0, description="The first N held-out prompts are answered at each evaluation.")
    samples: int = Field(1, gt=0, description="Answers per prompt (with temperature > 0; greedy needs one).")
    temperature: float = Field(0.0, ge=0, description="0: greedy; above: sampled, seeded by run.seed.")

    @model_validator(mode="after")
    def _greedy_answers_once(self) -> EvalSection:
        if self.temperature == 0 and self.samples > 1:
            raise ValueError("eval.samples > 1 needs eval.temperature > 0: greedy answers are all the same")
        return self
