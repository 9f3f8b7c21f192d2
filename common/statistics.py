"""The learner's statistics, named once: what each update reports, and where each one is shown.

One line of ``metrics.jsonl`` per update holds them (the trainer's, plus the learner's bookkeeping); this table says
which become Prometheus gauges (``streamppo_learner_<name>``), which the run summary and ``streamppo report``
average over the first and last updates, which the progress bar shows, and which plot draws each. The dashboard
queries only exported series (``tests/deploy/test_deploy.py``), and the trainer reports only statistics named here
(``tests/services/learner/test_trainer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LEARNER_STATISTICS", "PLOTS", "Plot", "Statistic", "gauges", "plotted", "progress_labels", "summarised"]


@dataclass(frozen=True)
class Statistic:
    name: str
    doc: str
    gauge: bool = False  # exported as the gauge streamppo_learner_<name>
    summary: bool = False  # averaged over the first and last updates by the run summary and `streamppo report`
    progress: str | None = None  # its label on the progress bar of `streamppo run`
    plot: str | None = None  # the PLOTS entry that draws it
    legend: str | None = None  # its line's label in that plot (default: its name)
    right_axis: bool = False  # drawn on its plot's second axis (another scale: β beside the KL)


@dataclass(frozen=True)
class Plot:
    title: str
    ylabel: str = ""
    right_ylabel: str = ""  # of a second axis, on the right, for the statistics marked right_axis
    whole_numbers: bool = False  # the values are counts (versions): whole-number ticks, never a ±0.04 axis


PLOTS: dict[str, Plot] = {
    "reward": Plot("Mean reward (reward model / function score)", "score"),
    "kl": Plot("KL to the reference (per token) and β", "KL per token (nats)", right_ylabel="β (KL coefficient)"),
    "losses": Plot("Policy and value loss", "loss"),
    "clip_fraction": Plot("Clip fraction"),
    "entropy": Plot("Policy entropy (per token)", "nats"),
    "explained_variance": Plot("Critic explained variance"),
    "stage_throughput": Plot("Per-stage throughput", "sequences / s of compute"),
    "staleness": Plot("Staleness of the experience trained on", "versions", whole_numbers=True),
    "held_out_reward": Plot("Held-out reward (the evaluator, eval.jsonl) against actor version", "score"),
}

_STATISTICS = (
    # What the experience says.
    Statistic("reward_mean", "mean score of the batch's responses", True, True, "reward", "reward", "reward"),
    Statistic("reward_std", "standard deviation of those scores"),
    Statistic("kl", "per-token KL estimate to the reference, mean", True, True, "kl", "kl", "KL"),
    Statistic("kl_per_sequence", "KL summed over each response, mean"),
    Statistic("kl_coef", "β after this update", True, True, plot="kl", legend="β", right_axis=True),
    Statistic(
        "explained_variance",
        "1 − Var(R − V) / Var(R) of the critic",
        True,
        True,
        plot="explained_variance",
        legend="explained variance",
    ),
    Statistic("advantage_mean", "mean advantage over the response tokens"),
    Statistic("response_length", "mean response length in tokens (the model's, in an episode)", True, True),
    Statistic("finished_frac", "share of responses that ended with EOS (an episode: that its environment ended)"),
    Statistic("turns_mean", "the model's turns per response (1 for single answers; more: tool calls, an environment)"),
    Statistic("environment_reward_mean", "mean reward the episodes' environments returned (0 for single answers)"),
    Statistic("logprob_mismatch", "mean |log π_old − log π_behaviour|: sampler against learner", True, True),
    Statistic("logprob_mismatch_max", "largest such gap of a token", True),
    Statistic("off_policy_tokens", "share of tokens the off-policy correction applies to (learner.off_policy)"),
    Statistic("off_policy_masked", "share of those it gave weight 0 (outside a band)", True),
    Statistic("off_policy_masked_sequences", "share of responses with such tokens that a sequence band masked"),
    Statistic("off_policy_weight", "mean weight it gave those tokens"),
    Statistic(
        "staleness",
        "mean versions between the learner and the policy that sampled each sequence",
        summary=True,
        plot="staleness",
        legend="versions behind",
    ),
    Statistic(
        "sampled_across_updates",
        "share of sequences that more than one version sampled (new weights landed while they were sampled)",
    ),
    Statistic("policy_version", "the learner's version after this update"),
    # What the update did (means over its optimizer steps).
    Statistic("policy_loss", "policy loss", True, True, "pg", "losses", "policy"),
    Statistic("value_loss", "critic's loss", True, True, "vf", "losses", "value"),
    Statistic("kl_loss", "the KL term of the loss (algorithm.kl_in: loss)"),
    Statistic("entropy", "policy entropy per token", True, True, plot="entropy", legend="entropy"),
    Statistic(
        "clip_frac",
        "share of tokens whose ratio was clipped",
        True,
        True,
        plot="clip_fraction",
        legend="clipped share of tokens",
    ),
    Statistic("approx_kl", "k3 estimate of KL(π_old ‖ π_θ): how far the update moved", True),
    Statistic("dual_clip_frac", "share of tokens bounded by the dual clip"),
    Statistic("value_clip_frac", "share of tokens whose clipped value error was larger"),
    Statistic("grad_norm_actor", "actor's gradient norm before clipping", True),
    Statistic("grad_norm_critic", "critic's gradient norm before clipping", True),
    Statistic("lr_factor", "the learning rates' share of their configured value (learner.lr_schedule)"),
    # The learner's bookkeeping of the update.
    Statistic("step", "updates applied, this one included"),
    Statistic("groups", "the keys (step/row) of the groups trained on"),
    Statistic("batch_ids", "the experience records that brought them"),
    Statistic("time", "seconds since the learner started"),
    Statistic("train_seconds", "seconds this update took"),
    Statistic("sequences", "responses in the batch"),
    Statistic("dropped_stale", "groups dropped so far as too stale or from an impossible version"),
    Statistic("no_signal_groups", "groups dropped so far for want of signal (algorithm.dynamic_sampling)"),
    Statistic("dead_lettered_groups", "groups so far every episode of which a gateway dead-lettered (never trained)"),
    Statistic("staleness_max", "versions between the learner and the oldest policy that sampled a sequence"),
    Statistic("staleness_counts", "groups trained at each staleness ({versions: groups})"),
    Statistic("digests", "the digests of the snapshots this update made ({model: digest}; streamppo replay)"),
)
LEARNER_STATISTICS: dict[str, Statistic] = {statistic.name: statistic for statistic in _STATISTICS}

# Computed by the report from each line: sequences per second of each stage's compute.
STAGES = ("generator", "scorer", "advantage", "learner")
THROUGHPUT = {
    f"throughput_{stage}": Statistic(
        f"throughput_{stage}", f"{stage} sequences / s", plot="stage_throughput", legend=stage
    )
    for stage in STAGES
}

# From the evaluator's lines (eval.jsonl), at the update that made each version (version v: after v updates).
EVALUATION = {
    "eval_reward_mean": Statistic(
        "eval_reward_mean", "mean score of the held-out prompts' answers", plot="held_out_reward", legend="held-out"
    )
}


def gauges() -> list[str]:
    return [s.name for s in LEARNER_STATISTICS.values() if s.gauge]


def summarised() -> list[str]:
    return [s.name for s in LEARNER_STATISTICS.values() if s.summary]


def progress_labels() -> dict[str, str]:
    """Progress bar label -> statistic."""
    return {s.progress: s.name for s in LEARNER_STATISTICS.values() if s.progress}


def plotted(plot: str) -> list[tuple[str, str, bool]]:
    """``(statistic, legend, on the right axis)`` of each line of ``plot``."""
    every = {**LEARNER_STATISTICS, **THROUGHPUT, **EVALUATION}.values()
    return [(s.name, s.legend or s.name, s.right_axis) for s in every if s.plot == plot]
