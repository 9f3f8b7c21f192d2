"""The algorithm's variants, declared once: every advantage estimator, policy loss, loss aggregation and KL
estimator, by name, with what it needs (a critic, groups of responses) and the settings it reads.

The configuration validates its choices against these declarations and derives its cross-field checks from them
(a setting that only other variants read, set explicitly, is refused; a variant without a critic refuses the
critic's settings; a group variant needs ``generation.n`` ≥ 2). The functions themselves live in
:mod:`common.ppo`, each registered under its declared name, and receive exactly the settings declared here as
keyword arguments (``tests/common/test_algorithms.py`` holds the two together). This module imports no torch, so the
command line and the configuration stay fast to load.

Adding a variant is its function (registered in ``common/ppo.py``), its declaration here, and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CRITIC_SETTINGS",
    "ESTIMATORS",
    "KINDS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "Kind",
    "Variant",
]


@dataclass(frozen=True)
class Variant:
    name: str
    summary: str  # one line for the configuration's description and the docs
    reads: tuple[str, ...] = ()
    """Settings of its kind's config section that it is given (as keyword arguments of its function); a setting that
    only other variants of the kind read is refused when set explicitly."""
    uses_critic: bool = False
    """True: the run has a critic (the advantage service computes values, the learner trains one); False: none
    anywhere."""
    needs_groups: bool = False
    """True: it compares the ``generation.n`` responses to one prompt, so ``n`` must be at least 2."""
    needs_kl_in_reward: bool = False
    """True: its signal is the KL in the token rewards, so ``algorithm.kl_in`` must be ``reward``."""


class Kind:
    """A family of variants, chosen by one setting: ``<section>.<field>``.

    ``title`` names the family in messages ("advantage estimator"); ``section`` is the config section that holds the
    choice and the variants' settings; ``field`` the setting that names the chosen variant.
    """

    def __init__(self, title: str, section: str, field: str, variants: list[Variant]):
        self.title, self.section, self.field = title, section, field
        self.variants: dict[str, Variant] = {variant.name: variant for variant in variants}

    @property
    def setting(self) -> str:
        return f"{self.section}.{self.field}"

    def __getitem__(self, name: str) -> Variant:
        try:
            return self.variants[name]
        except KeyError:
            raise ValueError(f"unknown {self.title} {name!r}; choose one of {', '.join(self.variants)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.variants

    def check(self, name: str) -> str:
        """``name`` if it is declared (a pydantic validator), else a ValueError naming the choices."""
        return self[name].name

    def chosen(self, section) -> Variant:
        """The variant a config section (e.g. ``config.algorithm``) chooses."""
        return self[getattr(section, self.field)]

    def settings(self, section) -> dict:
        """The chosen variant's settings, read from ``section``, as its function's keyword arguments."""
        return {name: getattr(section, name) for name in self.chosen(section).reads}

    def unread_settings(self, section) -> list[str]:
        """Settings that other variants of this kind read, set explicitly in ``section`` although the chosen variant
        does not read them."""
        read = set(self.chosen(section).reads)
        others = {name for variant in self.variants.values() for name in variant.reads} - read
        return [f"{self.section}.{name}" for name in sorted(others) if name in section.model_fields_set]

    def describe(self) -> str:
        """One line per variant, for the setting's description."""
        return "; ".join(f"{v.name}: {v.summary}" for v in self.variants.values())


ESTIMATORS = Kind(
    "advantage estimator",
    "algorithm",
    "estimator",
    [
        Variant(
            "gae",
            "PPO with a critic, GAE over the KL-shaped token rewards and the critic's values",
            reads=("gamma", "lam"),
            uses_critic=True,
        ),
        Variant("grpo", "(s_i − mean_g) / (std_g + ε) on every token (GRPO)", needs_groups=True),
        Variant("dr_grpo", "s_i − mean_g on every token (Dr. GRPO)", needs_groups=True),
        Variant("rloo", "s_i − the mean of the other responses to its prompt (RLOO)", needs_groups=True),
        Variant("reinforce_pp", "discounted returns, whitened over the batch (REINFORCE++)", reads=("gamma",)),
        Variant(
            "distill",
            "each token's own reward, undiscounted: with the reference a teacher, k1 and kl_coef 1, −(log π − log "
            "π_teacher) on every token (on-policy distillation)",
            needs_kl_in_reward=True,
        ),
        Variant(
            "reinforce_pp_baseline",
            "s_i − mean_g on every token, whitened over the batch (REINFORCE++ with a group baseline)",
            needs_groups=True,
        ),
    ],
)

POLICY_LOSSES = Kind(
    "policy loss",
    "learner",
    "policy_loss",
    [
        Variant(
            "ppo",
            "PPO's clipped surrogate −min(ρ·A, clip(ρ, 1−ε_low, 1+ε_high)·A), with an optional dual clip",
            reads=("clip_low", "clip_high", "dual_clip"),
        ),
        Variant(
            "gspo",
            "GSPO: PPO's clip on one ratio per response, the geometric mean of its token ratios (pair it with "
            "loss_agg seq-mean-token-mean)",
            reads=("gspo_clip_low", "gspo_clip_high"),
        ),
        Variant(
            "cispo",
            "CISPO: −sg[clip(ρ, 1−ε_low, 1+ε_high)]·A·log π, every token keeping its gradient",
            reads=("clip_low", "clip_high"),
        ),
    ],
)

LOSS_AGGREGATIONS = Kind(
    "loss aggregation",
    "learner",
    "loss_agg",
    [
        Variant("token-mean", "every token of a mini-batch alike"),
        Variant("seq-mean-token-mean", "every response alike (the mean of each response's token mean)"),
        Variant("seq-mean-token-sum", "the mean of each response's token sum"),
        Variant(
            "seq-mean-token-sum-norm",
            "token sums over the constant generation.max_new_tokens, then the mean (Dr. GRPO)",
        ),
    ],
)

KL_ESTIMATORS = Kind(
    "KL estimator",
    "algorithm",
    "kl_estimator",
    [
        Variant("k1", "log π − log π_ref"),
        Variant("k2", "½ (log π − log π_ref)²"),
        Variant("k3", "(r − 1) − log r with r = π_ref / π (non-negative; GRPO's)"),
    ],
)

KINDS = (ESTIMATORS, POLICY_LOSSES, LOSS_AGGREGATIONS, KL_ESTIMATORS)

# The settings of a critic, refused (when set explicitly) by a run whose estimator uses none.
CRITIC_SETTINGS = (
    "model.critic",
    "model.dtypes.critic",
    "learner.critic_lr",
    "learner.value_clip",
    "learner.value_coef",
    "algorithm.whiten_advantages",
)
