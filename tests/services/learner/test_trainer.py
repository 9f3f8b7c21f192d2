"""The learner's PPO update on a real tiny model."""

import copy
import dataclasses
import math

import pytest
import torch
from conftest import sampled_experience

from common.config import AlgorithmSection, LearnerSection, OffPolicy
from common.models import load_actor, load_critic
from common.sequences import pack, response_logprobs
from services.learner.trainer import PPOTrainer


def make_trainer(tiny_model, tokenizer, algorithm=None, temperature=1.0, **learner):
    settings = dict(ppo_epochs=1, mini_batch_size=8, actor_lr=1e-2, critic_lr=1e-2, max_grad_norm=None) | learner
    algorithm = algorithm or AlgorithmSection(whiten_advantages=False)
    return PPOTrainer(
        load_actor(tiny_model),
        load_critic(tiny_model) if algorithm.uses_critic else None,
        LearnerSection(**settings),
        algorithm,
        temperature=temperature,
        pad_token_id=tokenizer.pad_token_id,
        max_response_length=10,
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_accumulate_to_the_same_update(tiny_model, experience, agg):
    tokenizer, exp = experience
    whole = make_trainer(tiny_model, tokenizer, loss_agg=agg)
    split = make_trainer(tiny_model, tokenizer, loss_agg=agg, micro_batch_size=2)
    stats_whole, stats_split = whole.train(exp), split.train(exp)
    # One epoch, one mini-batch: the gradients left behind are the whole update's (Adam's first step would
    # turn float noise in near-zero gradients into ±lr, so compare what was accumulated, not the weights).
    for model in ("actor", "critic"):
        grads_whole = [p.grad for p in getattr(whole, model).parameters()]
        grads_split = [p.grad for p in getattr(split, model).parameters()]
        assert all(g is not None for g in grads_whole)
        for a, b in zip(grads_whole, grads_split):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), model
    assert stats_whole["policy_loss"] == pytest.approx(stats_split["policy_loss"], abs=1e-5)
    assert stats_whole["grad_norm_actor"] == pytest.approx(stats_split["grad_norm_actor"], rel=1e-4)


def test_an_update_moves_log_probs_in_the_direction_of_the_advantage(tiny_model, experience):
    tokenizer, exp = experience
    trainer = make_trainer(tiny_model, tokenizer, actor_lr=1e-3)
    before = copy.deepcopy(trainer.actor)
    stats = trainer.train(exp)
    assert trainer.version == 1 and stats["policy_version"] == 1
    packed = pack(
        exp.prompt_tokens, exp.prompt_lengths, exp.response_tokens, exp.response_lengths, tokenizer.pad_token_id
    )
    with torch.no_grad():
        old, _ = response_logprobs(before, packed, exp.response_tokens)
        new, _ = response_logprobs(trainer.actor, packed, exp.response_tokens)
    mask = exp.mask
    # First-order effect of one SGD-like step: Σ A·Δlogp > 0.
    assert float(((new - old) * exp.advantages * mask).sum()) > 0
    assert stats["logprob_mismatch"] < 1e-4  # same weights as the sampler, so π_old == π_behaviour
    assert 0 <= stats["clip_frac"] <= 1


@pytest.mark.parametrize("temperature", [0.5, 1.5])
def test_the_first_step_is_on_policy_at_any_sampling_temperature(tiny_model, temperature):
    """π_old is the policy the loss differentiates, at the sampling temperature: before the first optimizer step
    every ratio is exactly 1 (nothing clipped) and π_old equals the sampler's log-probs."""
    texts = ["tell me about the cat.", "hi", "say something!", "the sea"]
    tokenizer, exp = sampled_experience(tiny_model, texts, 10, seed=3, temperature=temperature)
    stats = make_trainer(tiny_model, tokenizer, temperature=temperature, actor_lr=1e-3).train(exp)
    assert stats["logprob_mismatch_max"] < 1e-4
    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == pytest.approx(0.0, abs=1e-7)


def test_value_loss_falls_over_updates(tiny_model, experience):
    tokenizer, exp = experience
    trainer = make_trainer(tiny_model, tokenizer, ppo_epochs=4, critic_lr=1e-2, value_clip=None)
    losses = [trainer.train(exp)["value_loss"] for _ in range(5)]
    assert losses[-1] < losses[0] * 0.7


def test_stale_experience_gets_importance_weights_and_any_experience_with_applies_to_all(tiny_model, experience):
    tokenizer, exp = experience
    # The sampler's log-probs 0.5 below the learner's: π_old / π_behaviour = e^0.5 ≈ 1.65 on every token, under
    # the cap of 2.
    shifted = dataclasses.replace(exp, behaviour_logprobs=exp.behaviour_logprobs - 0.5 * exp.mask)

    def update(applies_to: str, version: int):
        trainer = make_trainer(tiny_model, tokenizer, off_policy=OffPolicy(applies_to=applies_to))
        trainer.version = version  # the experience (v0) is `version` versions behind
        stats = trainer.train(shifted)
        return stats, {k: v.clone() for k, v in trainer.actor.state_dict().items()}

    corrected, corrected_actor = update("stale", 1)
    ignored, ignored_actor = update("none", 1)
    fresh, fresh_actor = update("stale", 0)
    always, always_actor = update("all", 0)
    assert corrected["staleness"] == 1 and fresh["staleness"] == 0
    # One step from π_old (ratio 1, nothing clipped): the weighted loss is the plain one times e^0.5.
    assert corrected["policy_loss"] == pytest.approx(math.exp(0.5) * ignored["policy_loss"], rel=1e-4)
    assert corrected["off_policy_tokens"] == 1.0 and corrected["off_policy_weight"] == pytest.approx(math.exp(0.5))
    assert any(not torch.equal(corrected_actor[k], ignored_actor[k]) for k in corrected_actor), "weights applied"
    assert all(torch.equal(fresh_actor[k], ignored_actor[k]) for k in fresh_actor), "on-policy data: no weights"
    assert fresh["off_policy_tokens"] == 0.0
    # applies_to all: the sampler's mismatch is corrected at staleness 0 too, exactly as a stale batch's.
    assert always["policy_loss"] == pytest.approx(corrected["policy_loss"], rel=1e-6)
    assert all(torch.equal(always_actor[k], corrected_actor[k]) for k in always_actor)


def test_a_band_masks_the_tokens_outside_it_from_the_update(tiny_model, experience):
    tokenizer, exp = experience
    # Every token's ratio is e^0.5 ≈ 1.65: outside a token band [0.5, 1.5], so every token is masked and the policy
    # loss is zero; inside [0.5, 2], so nothing is.
    shifted = dataclasses.replace(exp, behaviour_logprobs=exp.behaviour_logprobs - 0.5 * exp.mask)
    outside = make_trainer(tiny_model, tokenizer, off_policy=OffPolicy(applies_to="all", token_band=(0.5, 1.5)))
    inside = make_trainer(tiny_model, tokenizer, off_policy=OffPolicy(applies_to="all", token_band=(0.5, 2.0)))
    masked, kept = outside.train(shifted), inside.train(shifted)
    assert masked["off_policy_masked"] == 1.0 and masked["policy_loss"] == 0.0
    assert kept["off_policy_masked"] == 0.0 and kept["policy_loss"] != 0.0


def test_a_critic_free_trainer_has_no_critic_to_train_save_or_publish(tiny_model, experience, tmp_path):
    tokenizer, exp = experience
    trainer = make_trainer(tiny_model, tokenizer, AlgorithmSection(estimator="grpo"))
    assert [name for name, _, _ in trainer.models()] == ["actor"]
    before = copy.deepcopy(trainer.actor)
    stats = trainer.train(exp)
    assert "grad_norm_critic" not in stats and "value_loss" not in stats and "explained_variance" not in stats
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), trainer.actor.parameters()))
    trainer.save(tmp_path)
    saved = torch.load(tmp_path / "trainer.pt", weights_only=True)
    assert "critic" not in saved and "critic_optimizer" not in saved and "actor_optimizer" in saved
    # A checkpoint of a critic-free run does not resume a run with a critic (nor the other way round).
    with_critic = make_trainer(tiny_model, tokenizer)
    with pytest.raises(RuntimeError, match="holds no critic: it was written with another estimator"):
        with_critic.load(tmp_path)
    with pytest.raises(ValueError, match="estimator grpo takes no critic"):
        PPOTrainer(
            load_actor(tiny_model),
            load_critic(tiny_model),
            LearnerSection(),
            AlgorithmSection(estimator="grpo"),
            temperature=1.0,
            pad_token_id=tokenizer.pad_token_id,
        )


@pytest.mark.parametrize("kl_in", ["reward", "loss"])
def test_kl_in_the_loss_pulls_the_policy_toward_the_reference(tiny_model, experience, kl_in):
    tokenizer, exp = experience
    # Nothing to gain from the advantages; the reference puts every sampled token 1 nat below the policy.
    still = dataclasses.replace(
        exp, advantages=torch.zeros_like(exp.advantages), ref_logprobs=exp.behaviour_logprobs - exp.mask
    )
    algorithm = AlgorithmSection(estimator="grpo", kl_in=kl_in, kl_estimator="k3", kl_coef=1.0)
    trainer = make_trainer(tiny_model, tokenizer, algorithm, actor_lr=1e-3)
    before = copy.deepcopy(trainer.actor)
    stats = trainer.train(still)
    packed = pack(
        exp.prompt_tokens, exp.prompt_lengths, exp.response_tokens, exp.response_lengths, tokenizer.pad_token_id
    )
    with torch.no_grad():
        old, _ = response_logprobs(before, packed, exp.response_tokens)
        new, _ = response_logprobs(trainer.actor, packed, exp.response_tokens)
    moved = float(((new - old) * exp.mask).sum())
    if kl_in == "reward":  # the KL was in the rewards the advantages came from: the loss has no KL term
        assert "kl_loss" not in stats and moved == 0.0
    else:  # k3's gradient lowers log π where π_ref is lower
        assert stats["kl_loss"] > 0 and moved < 0


def test_every_statistic_the_trainer_reports_is_named_in_the_table(tiny_model, experience):
    """common/statistics.py is the one list of them: gauges, summaries, the progress bar and the plots read it."""
    from common.statistics import LEARNER_STATISTICS

    tokenizer, exp = experience
    reported = set(make_trainer(tiny_model, tokenizer, dual_clip=3.0).train(exp))
    grpo = AlgorithmSection(estimator="grpo", kl_in="loss", kl_estimator="k3")
    with_reference = dataclasses.replace(exp, ref_logprobs=exp.behaviour_logprobs - 0.1)
    reported |= set(make_trainer(tiny_model, tokenizer, grpo).train(with_reference))
    assert "kl_loss" in reported
    assert reported and reported <= set(LEARNER_STATISTICS), sorted(reported - set(LEARNER_STATISTICS))


def test_the_learning_rate_schedule_is_a_function_of_the_update_so_a_restart_continues_it(tiny_model, experience):
    from common.ppo import lr_factor

    tokenizer, exp = experience
    trainer = make_trainer(tiny_model, tokenizer, lr_schedule="linear")
    trainer.total_updates = 4
    trainer.version = 2  # as a learner back from its checkpoint at v2
    stats = trainer.train(exp)
    assert stats["lr_factor"] == 0.5 and trainer.actor_optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-2)
    assert trainer.critic_optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-2)

    assert [lr_factor(u, 4, "constant") for u in range(4)] == [1.0] * 4
    # Linear to 0 one update past the last, as TRL's per-step linear schedule: 1, 3/4, 1/2, 1/4.
    assert [lr_factor(u, 4, "linear") for u in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert [lr_factor(u, 5, "linear", warmup=1, min_ratio=0.2) for u in range(5)] == pytest.approx(
        [1.0, 1.0, 0.8, 0.6, 0.4]
    )
    assert [lr_factor(u, 3, "cosine") for u in range(3)] == pytest.approx([1.0, 0.75, 0.25])
    assert [lr_factor(u, 10, "cosine", warmup=4) for u in range(3)] == [0.25, 0.5, 0.75]
