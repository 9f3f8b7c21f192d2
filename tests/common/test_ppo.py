"""The PPO math against the seeds' worked numbers, plain-loop references, gradients and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import ppo
from common.algorithms import ESTIMATORS

# The seeds' example: "吃 苹 果", actor and reference probabilities (0.4, 0.5, 0.6) and (0.38, 0.55, 0.58).
ACTOR = torch.tensor([[-0.916, -0.693, -0.511]])
REFERENCE = torch.tensor([[-0.967, -0.598, -0.544]])


def test_seed_k1_matches_the_worked_numbers():
    k1 = ppo.kl_estimate(ACTOR, REFERENCE, "k1")
    assert torch.allclose(k1, torch.tensor([[0.051, -0.095, 0.033]]), atol=1e-6)


def test_seed_k2_and_k3_follow_their_definitions():
    d = ACTOR - REFERENCE
    assert torch.allclose(ppo.kl_estimate(ACTOR, REFERENCE, "k2"), 0.5 * d**2)
    k3 = ppo.kl_estimate(ACTOR, REFERENCE, "k3")
    expected = [math.exp(-x) + x - 1 for x in d[0].tolist()]
    assert torch.allclose(k3[0], torch.tensor(expected), atol=1e-7)
    assert (k3 >= 0).all()


def test_unknown_kl_estimator_is_a_clear_error():
    with pytest.raises(ValueError, match="k4"):
        ppo.kl_estimate(ACTOR, REFERENCE, "k4")


def test_seed_driving_example_td_error():
    # V(s0) = 60, r0 = 10, V(s1) = 45, γ = 1: δ0 = 10 + 45 − 60 = −5. With λ = 0, A0 = δ0.
    rewards = torch.tensor([[10.0, 0.0]])
    values = torch.tensor([[60.0, 45.0]])
    advantages, returns = ppo.gae(rewards, values, torch.ones(1, 2), gamma=1.0, lam=0.0)
    assert advantages[0, 0].item() == pytest.approx(-5.0)
    assert returns[0, 0].item() == pytest.approx(55.0)  # the corrected estimate of the seeds: 10 + 45
    # The last real token bootstraps from V = 0: δ1 = 0 + 0 − 45.
    assert advantages[0, 1].item() == pytest.approx(-45.0)


def test_seed_gamma_099_two_step_advantage():
    # Â_t^(2) = δ_t + γλ·δ_{t+1} for a 2-token response with λ = 1.
    rewards = torch.tensor([[0.5, 2.0]])
    values = torch.tensor([[1.0, 1.5]])
    gamma = 0.99
    delta0 = 0.5 + gamma * 1.5 - 1.0
    delta1 = 2.0 + 0.0 - 1.5
    advantages, _ = ppo.gae(rewards, values, torch.ones(1, 2), gamma=gamma, lam=1.0)
    assert advantages[0, 0].item() == pytest.approx(delta0 + gamma * delta1, rel=1e-6)


def reference_gae(rewards, values, lengths, gamma, lam):
    """GAE as the textbook writes it, one row at a time over the real tokens only."""
    advantages = torch.zeros_like(rewards)
    for b, length in enumerate(lengths):
        last = 0.0
        for t in reversed(range(length)):
            next_value = values[b, t + 1].item() if t + 1 < length else 0.0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            last = delta + gamma * lam * last
            advantages[b, t] = last
    return advantages


@pytest.mark.parametrize("seed", range(5))
def test_gae_matches_a_plain_loop_on_right_padded_batches(seed):
    g = torch.Generator().manual_seed(seed)
    batch, width = 6, 11
    lengths = torch.randint(0, width + 1, (batch,), generator=g)
    mask = (torch.arange(width) < lengths[:, None]).float()
    # Garbage at padding must not leak into the real positions.
    rewards = torch.randn(batch, width, generator=g) * 3
    values = torch.randn(batch, width, generator=g) * 3
    gamma, lam = [(1.0, 0.95), (0.99, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0)][seed]
    advantages, returns = ppo.gae(rewards, values, mask, gamma, lam)
    expected = reference_gae(rewards, values, lengths.tolist(), gamma, lam)
    assert torch.allclose(advantages, expected, atol=1e-5)
    assert torch.allclose(returns, (expected + values) * mask, atol=1e-5)
    assert (advantages[mask == 0] == 0).all()


def test_gae_skips_interior_gaps_in_the_mask():
    rewards = torch.tensor([[1.0, 100.0, 2.0]])
    values = torch.tensor([[0.5, 100.0, 0.25]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    advantages, _ = ppo.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # As if the sequence were [1, 2] with values [0.5, 0.25].
    expected = reference_gae(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 0.25]]), [2], 1.0, 1.0)
    assert torch.allclose(advantages[0, [0, 2]], expected[0], atol=1e-6)


def test_token_rewards_put_the_score_on_the_last_real_token():
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    scores = torch.tensor([2.0, -1.0, 5.0])
    rewards = ppo.token_rewards(scores, kl, mask, kl_coef=0.1)
    expected = torch.tensor([[-0.01, -0.02, 2.0 - 0.03, 0.0], [-1.0 - 0.05, 0, 0, 0], [0, 0, 0, 0]])
    assert torch.allclose(rewards, expected, atol=1e-6)


def test_token_rewards_clip_scores_and_take_a_per_row_beta():
    kl = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    rewards = ppo.token_rewards(torch.tensor([10.0, -10.0]), kl, mask, kl_coef=torch.tensor([0.1, 0.2]), clip=3.0)
    assert rewards[:, -1].tolist() == [3.0, -3.0]


def test_missing_eos_penalty_only_hits_truncated_responses():
    scores = ppo.missing_eos_penalty(torch.tensor([1.0, 1.0]), torch.tensor([True, False]), penalty=0.5)
    assert scores.tolist() == [1.0, 0.5]


def test_logprobs_and_entropy_match_torch_distributions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g)
    tokens = torch.randint(0, 7, (3, 5), generator=g)
    dist = torch.distributions.Categorical(logits=logits)
    assert torch.allclose(ppo.logprobs_from_logits(logits, tokens), dist.log_prob(tokens), atol=1e-6)
    assert torch.allclose(ppo.entropy_from_logits(logits), dist.entropy(), atol=1e-5)


def test_masked_whiten_normalises_over_real_tokens_only():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=g) * 5 + 3
    mask = (torch.arange(6) < torch.tensor([[6], [3], [1], [4]])).float()
    x_padded = torch.where(mask.bool(), x, torch.full_like(x, 1e6))
    w = ppo.masked_whiten(x_padded, mask)
    real = w[mask.bool()]
    assert real.mean().abs() < 1e-5
    assert (real.var(unbiased=True) - 1).abs() < 1e-4
    assert (w[~mask.bool()] == 0).all()


def _ratio_setup(ratio_values, advantage_values):
    old = torch.zeros(1, len(ratio_values))
    logp = torch.log(torch.tensor([ratio_values])).requires_grad_(True)
    advantages = torch.tensor([advantage_values])
    return logp, old, advantages, torch.ones(1, len(ratio_values))


def test_clipped_tokens_contribute_no_gradient():
    # token 0: ratio 1.5 > 1 + ε with A > 0 → clipped; token 1: ratio 0.5 < 1 − ε with A < 0 → clipped;
    # token 2: ratio 1.1 inside the trust region → gradient A·ratio/T; token 3: ratio 0.5 with A > 0 → not clipped.
    logp, old, adv, mask = _ratio_setup([1.5, 0.5, 1.1, 0.5], [1.0, -1.0, 2.0, 1.0])
    loss, stats = ppo.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    grad = logp.grad[0]
    assert grad[0] == 0 and grad[1] == 0
    assert grad[2].item() == pytest.approx(-2.0 * 1.1 / 4, rel=1e-5)
    assert grad[3].item() == pytest.approx(-1.0 * 0.5 / 4, rel=1e-5)
    assert stats.clip_frac.item() == pytest.approx(0.5)


def test_clip_higher_uses_separate_bounds():
    logp, old, adv, mask = _ratio_setup([1.25], [1.0])
    loss_sym, _ = ppo.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss_high, _ = ppo.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss_sym.item() == pytest.approx(-1.2)
    assert loss_high.item() == pytest.approx(-1.25)


def test_dual_clip_bounds_the_loss_for_negative_advantages():
    logp, old, adv, mask = _ratio_setup([10.0, 10.0], [-1.0, 1.0])
    loss, stats = ppo.policy_loss(logp, old, adv, mask, dual_clip=3.0, agg="seq-mean-token-sum")
    loss.backward()
    # A < 0: unbounded loss would be 10; dual clip caps it at −c·A = 3, with no gradient.
    # A > 0: ratio clipped at 1.2 → −1.2, no gradient either.
    assert loss.item() == pytest.approx(3.0 - 1.2)
    assert logp.grad.abs().sum() == 0
    assert stats.dual_clip_frac.item() == pytest.approx(0.5)
    with pytest.raises(ValueError):
        ppo.policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_importance_weights_scale_the_per_token_loss():
    logp, old, adv, mask = _ratio_setup([1.0, 1.0], [1.0, 1.0])
    behaviour = torch.tensor([[-5.0, -0.1]])
    weights, _ = ppo.off_policy_weights(torch.tensor([[0.0, 0.0]]), behaviour, mask.bool(), token_cap=2.0)
    assert weights[0, 0].item() == pytest.approx(2.0)  # e^5, truncated at C
    assert weights[0, 1].item() == pytest.approx(math.exp(0.1), rel=1e-6)
    loss, _ = ppo.policy_loss(logp, old, adv, mask, importance_weights=weights)
    assert loss.item() == pytest.approx(-(2.0 + math.exp(0.1)) / 2, rel=1e-6)


def test_off_policy_weights_on_worked_numbers():
    # log r = log π_old − log π_behaviour per token. Row 0: 0.1, −0.1, 1.0 (r = 1.105, 0.905, 2.718);
    # row 1: 0.2, 0.2, padding (r = 1.221, 1.221); row 2: −0.3, 0.0, 0.0, not corrected (a fresh response).
    log_r = torch.tensor([[0.1, -0.1, 1.0], [0.2, 0.2, 0.0], [-0.3, 0.0, 0.0]])
    corrected = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    old, behaviour = log_r, torch.zeros(3, 3)
    e = math.exp

    weights, stats = ppo.off_policy_weights(old, behaviour, corrected, token_cap=2.0)
    expected = torch.tensor([[e(0.1), e(-0.1), 2.0], [e(0.2), e(0.2), 1.0], [1.0, 1.0, 1.0]])
    assert torch.allclose(weights, expected, rtol=1e-6)
    assert stats.masked_tokens.item() == 0.0

    # IcePop: row 0's third token (r = 2.718) is outside [0.5, 2]; masked, the rest weighted as before.
    weights, stats = ppo.off_policy_weights(old, behaviour, corrected, token_cap=2.0, token_band=(0.5, 2.0))
    assert weights[0, 2].item() == 0.0 and weights[0, 0].item() == pytest.approx(e(0.1))
    assert stats.masked_tokens.item() == pytest.approx(1 / 5)

    # The product: row 0's is e^1.0 = 2.718, row 1's e^0.4 = 1.49; a band [0.5, 2] masks row 0 whole.
    weights, stats = ppo.off_policy_weights(old, behaviour, corrected, token_cap=None, sequence_band=(0.5, 2.0))
    assert (weights[0] == 0).all() and torch.allclose(weights[1], torch.tensor([1.0, 1.0, 1.0]))
    assert stats.masked_sequences.item() == pytest.approx(1 / 2)
    assert (weights[2] == 1).all(), "a response with no corrected token is never masked"

    # The geometric mean: row 0's e^(1.0/3) = 1.396, row 1's e^0.2 = 1.221; a band [0.8, 1.3] masks row 0 only,
    # though its product (2.718) is far further out than its geometric mean.
    weights, _ = ppo.off_policy_weights(old, behaviour, corrected, token_cap=None, geometric_band=(0.8, 1.3))
    assert (weights[0] == 0).all() and (weights[1, :2] == 1).all()
    weights, _ = ppo.off_policy_weights(old, behaviour, corrected, token_cap=None, geometric_band=(0.8, 1.4))
    assert (weights[:2, :2] == 1).all()


def test_value_loss_is_the_clipped_maximum():
    values = torch.tensor([[2.0, 0.05]], requires_grad=True)
    old = torch.zeros(1, 2)
    returns = torch.tensor([[2.0, 1.0]])
    loss, stats = ppo.value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    # token 0: unclipped error 0, clipped value 0.2 → error 3.24; the max keeps 3.24 (and no gradient).
    # token 1: inside the clip range; both errors 0.9025.
    assert loss.item() == pytest.approx(0.5 * (3.24 + 0.9025) / 2, rel=1e-5)
    loss.backward()
    assert values.grad[0, 0] == 0 and values.grad[0, 1] != 0
    assert stats.clip_frac.item() == pytest.approx(0.5)


def test_agg_loss_modes_and_global_token_count():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert ppo.agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert ppo.agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert ppo.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert ppo.agg_loss(loss, mask, "token-mean", num_tokens=8).item() == pytest.approx(10 / 8)


def test_adaptive_kl_controller_follows_ziegler():
    ctl = ppo.AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=100)  # error 0.5, clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    ctl.update(current_kl=5.4, n_steps=100)  # error −0.1
    assert ctl.value == pytest.approx(0.1 * (1 + 0.002) * (1 - 0.1 * 0.01))
    restored = ppo.AdaptiveKLController(0.5, target=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    fixed = ppo.FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert ppo.explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full_like(returns, 2.5), returns, mask).item() == pytest.approx(0.0, abs=1e-6)


# --------------------------------------------------------------------------------------------- properties

finite = st.floats(-10, 10, allow_nan=False, width=32)


@st.composite
def batches(draw):
    batch = draw(st.integers(1, 4))
    width = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    rewards = torch.tensor(
        draw(st.lists(st.lists(finite, min_size=width, max_size=width), min_size=batch, max_size=batch))
    )
    values = torch.tensor(
        draw(st.lists(st.lists(finite, min_size=width, max_size=width), min_size=batch, max_size=batch))
    )
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).float()
    return rewards, values, mask


@settings(max_examples=200, deadline=None)
@given(batches(), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_property_returns_are_advantages_plus_values(batch, gamma, lam):
    rewards, values, mask = batch
    advantages, returns = ppo.gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(returns, (advantages + values) * mask, atol=1e-4)
    assert (advantages * (1 - mask) == 0).all()


@settings(max_examples=200, deadline=None)
@given(batches())
def test_property_monte_carlo_limit(batch):
    # γ = λ = 1: the advantage is the reward-to-go minus the value, whatever the values are.
    rewards, values, mask = batch
    advantages, _ = ppo.gae(rewards, values, mask, 1.0, 1.0)
    to_go = (rewards * mask).flip(1).cumsum(1).flip(1)
    assert torch.allclose(advantages, (to_go - values) * mask, atol=1e-3)


@settings(max_examples=200, deadline=None)
@given(batches(), st.floats(0.0, 1.0))
def test_property_token_rewards_sum_to_score_minus_kl_penalty(batch, beta):
    kl, _, mask = batch
    scores = kl[:, 0] * 2
    rewards = ppo.token_rewards(scores, kl, mask, beta)
    has_tokens = mask.sum(1) > 0
    expected = torch.where(has_tokens, scores - beta * (kl * mask).sum(1), torch.zeros_like(scores))
    assert torch.allclose(rewards.sum(1), expected, atol=1e-3)


@settings(max_examples=200, deadline=None)
@given(batches())
def test_property_on_policy_loss_is_minus_mean_advantage(batch):
    advantages, logp, mask = batch
    loss, stats = ppo.policy_loss(logp, logp.clone(), advantages, mask)
    assert loss.item() == pytest.approx(-ppo.masked_mean(advantages, mask).item(), abs=1e-4)
    assert stats.clip_frac.item() == 0
    assert stats.approx_kl.item() == pytest.approx(0.0, abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(batches())
def test_property_k3_is_non_negative_and_zero_on_equal_policies(batch):
    a, b, _ = batch
    assert (ppo.kl_estimate(a, b, "k3") >= -1e-6).all()
    assert torch.allclose(ppo.kl_estimate(a, a, "k3"), torch.zeros_like(a))


# --------------------------------------------------------------------------------------------- critic-free estimators

# Two prompts, three responses each; prompt 1's responses all score 2 (a group with nothing to learn from).
GROUP_SCORES = [1.0, 0.0, 0.5, 2.0, 2.0, 2.0]
GROUP_INDEX = torch.tensor([0, 0, 0, 1, 1, 1])
GROUP_LENGTHS = [3, 2, 1, 3, 3, 2]


def outcome_rewards(scores, lengths, width=4):
    """Token rewards with each score on its response's last token (no KL term), and the mask."""
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).float()
    rewards = torch.zeros(len(scores), width)
    for i, (score, length) in enumerate(zip(scores, lengths)):
        if length:
            rewards[i, length - 1] = score
    return rewards, mask


@pytest.mark.parametrize(
    "estimator, per_response",
    [
        # group 0: mean 0.5, std (Bessel) 0.5; group 1: std 0, so 0 / (0 + ε)
        ("grpo", [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0, 0.0, 0.0, 0.0]),
        ("dr_grpo", [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]),
        # 1 − mean(0, 0.5) = 0.75; 0 − mean(1, 0.5) = −0.75; 0.5 − mean(1, 0) = 0
        ("rloo", [0.75, -0.75, 0.0, 0.0, 0.0, 0.0]),
    ],
)
def test_group_estimators_on_worked_numbers(estimator, per_response):
    rewards, mask = outcome_rewards(GROUP_SCORES, GROUP_LENGTHS)
    advantages, returns = estimate(estimator, ppo.EstimatorInput(rewards, torch.zeros_like(rewards), mask, GROUP_INDEX))
    expected = torch.tensor(per_response)[:, None] * mask  # the same advantage on every token of a response
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.equal(returns, advantages)


def test_reinforce_pp_baseline_centres_on_the_group_then_whitens_the_batch():
    rewards, mask = outcome_rewards(GROUP_SCORES, GROUP_LENGTHS)
    advantages, _ = ppo.reinforce_pp_baseline(rewards, mask, GROUP_INDEX)
    # Centred: 0.5 on 3 tokens, −0.5 on 2, 0 on the other 9 of the 14 real tokens: mean 0.5/14, Bessel variance.
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 0.0])[:, None] * mask
    values = centred[mask.bool()]
    mean, var = values.mean(), values.var(unbiased=True)
    assert float(mean) == pytest.approx(0.5 / 14)
    assert torch.allclose(advantages, (centred - mean) / torch.sqrt(var + 1e-8) * mask, atol=1e-6)
    assert float(advantages[mask.bool()].mean()) == pytest.approx(0.0, abs=1e-6)


def test_reinforce_pp_discounts_the_kl_shaped_rewards_within_each_response():
    # One response of 3 tokens, rewards −0.1, −0.2, 1 − 0.3 (KL-shaped, score 1), γ = 0.5; a second of 1 token.
    rewards = torch.tensor([[-0.1, -0.2, 0.7], [2.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages, returns = ppo.reinforce_pp(rewards, mask, gamma=0.5)
    # R_2 = 0.7; R_1 = −0.2 + 0.35 = 0.15; R_0 = −0.1 + 0.075 = −0.025; the second row's padding never counts.
    assert torch.allclose(returns, torch.tensor([[-0.025, 0.15, 0.7], [2.0, 0.0, 0.0]]), atol=1e-6)
    real = torch.tensor([-0.025, 0.15, 0.7, 2.0])
    whitened = (real - real.mean()) / torch.sqrt(real.var(unbiased=True) + 1e-8)
    assert torch.allclose(advantages[mask.bool()], whitened, atol=1e-6)
    assert (advantages[mask == 0] == 0).all()


def estimate(estimator, x, gamma=1.0, lam=0.95):
    """The registered estimator, given the settings its declaration names."""
    given = {name: value for name, value in {"gamma": gamma, "lam": lam}.items() if name in ESTIMATORS[estimator].reads}
    return ppo.ADVANTAGE_ESTIMATORS[estimator](x, **given)


def reference_outcomes(rewards, lengths):
    return [sum(rewards[i, t].item() for t in range(length)) for i, length in enumerate(lengths)]


def reference_group_advantages(estimator, rewards, lengths, groups, eps=1e-6):
    """The group estimators written as plain loops over lists, from their papers' formulas."""
    scores = reference_outcomes(rewards, lengths)
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        n = len(members)
        mean = sum(members) / n if n > 1 else 0.0
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1)) if n > 1 else 1.0
        if estimator == "grpo":
            out.append((s - mean) / (std + eps))
        elif estimator in ("dr_grpo", "reinforce_pp_baseline"):
            out.append(s - mean)
        elif estimator == "rloo":
            out.append(s - (sum(members) - s) / (n - 1) if n > 1 else s)  # the mean of the others
    return out


def reference_whiten(values_by_row, lengths):
    real = [values_by_row[i][t] for i, length in enumerate(lengths) for t in range(length)]
    mean = sum(real) / len(real)
    var = sum((x - mean) ** 2 for x in real) / (len(real) - 1)
    return [
        [(values_by_row[i][t] - mean) / math.sqrt(var + 1e-8) for t in range(length)]
        for i, length in enumerate(lengths)
    ]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("seed", range(3))
def test_critic_free_estimators_match_plain_loops(estimator, seed):
    g = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, 4, (12,), generator=g)  # uneven groups, some of one response
    width = 7
    lengths = torch.randint(1, width + 1, (12,), generator=g).tolist()
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).float()
    rewards = torch.randn(12, width, generator=g) * mask  # KL-shaped: a reward on every token
    gamma = [1.0, 0.9, 0.5][seed]
    advantages, _ = estimate(estimator, ppo.EstimatorInput(rewards, torch.zeros_like(rewards), mask, groups), gamma)
    if estimator == "reinforce_pp":
        returns = []
        for i, length in enumerate(lengths):
            row, running = [0.0] * length, 0.0
            for t in reversed(range(length)):
                running = rewards[i, t].item() + gamma * running
                row[t] = running
            returns.append(row)
        expected_rows = reference_whiten(returns, lengths)
    else:
        per_response = reference_group_advantages(estimator, rewards, lengths, groups.tolist())
        expected_rows = [[a] * length for a, length in zip(per_response, lengths)]
        if estimator == "reinforce_pp_baseline":
            expected_rows = reference_whiten(expected_rows, lengths)
    for i, length in enumerate(lengths):
        assert torch.allclose(advantages[i, :length], torch.tensor(expected_rows[i]), atol=1e-5), (estimator, i)
        assert (advantages[i, length:] == 0).all()


def test_dr_grpo_aggregation_divides_token_sums_by_a_constant_length():
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    # Token sums 6 and 4; their mean 5, over the longest response the sampler may write (10).
    assert float(ppo.agg_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=10)) == pytest.approx(0.5)
    # Unlike seq-mean-token-mean, a response's length does not change its tokens' weight.
    assert float(ppo.agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((2.0 + 4.0) / 2)
    with pytest.raises(ValueError, match="needs norm_length"):
        ppo.agg_loss(loss, mask, "seq-mean-token-sum-norm")


# --------------------------------------------------------------------------------------------- numerics of groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_equal_scores_gets_exactly_zero_advantage_in_any_dtype(estimator, dtype):
    """Six scores of 2.1 (not representable): a mean taken by summing rounds to 2.0999999 in float32, and GRPO's
    (s − mean) / (std + ε) then gave every response −0.24 instead of 0 (verl has that defect)."""
    scores = [2.1] * 6 + [0.3] * 3 + [1.0, 0.0, 1.0]
    groups = torch.tensor([0] * 6 + [1] * 3 + [2] * 3)
    rewards, mask = outcome_rewards(scores, [4] * 12)
    x = ppo.EstimatorInput(rewards.to(dtype), torch.zeros_like(rewards, dtype=dtype), mask.to(dtype), groups)
    advantages, _ = estimate(estimator, x)
    assert (advantages[:9] == 0).all(), advantages[:9, 0]
    assert (advantages[9:, 0] != 0).all(), "the group with signal keeps it"
    as_summed = torch.tensor([2.1] * 6)
    assert (as_summed - as_summed.sum() / 6).abs().max() > 0, "the case this guards against is real in float32"


def test_k3_is_not_clamped_so_the_tokens_furthest_from_the_reference_keep_their_gradient():
    # log(π_ref/π) = 3: k3 = e³ − 3 − 1 ≈ 16.09; verl clamps it to 10 and that token's gradient to 0.
    logp = torch.tensor([[-4.0]], requires_grad=True)
    k3 = ppo.kl_estimate(logp, torch.tensor([[-1.0]]), "k3")
    assert k3.item() == pytest.approx(math.exp(3) - 4, rel=1e-6)
    k3.sum().backward()
    assert logp.grad.item() == pytest.approx(-(math.exp(3) - 1), rel=1e-6)  # d/dlogp of e^(ref−logp) − (ref−logp)


def test_overlong_penalty_on_worked_numbers():
    # limit 20 tokens, buffer 5: no penalty up to 15, then linear to the whole penalty at 20
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([10, 15, 16, 20])
    shaped = ppo.overlong_penalty(scores, lengths, max_length=20, buffer=5, penalty=1.0)
    assert torch.allclose(shaped, torch.tensor([1.0, 1.0, 0.8, 0.0]))
    assert torch.allclose(ppo.overlong_penalty(scores, lengths, 20, 5, penalty=0.5), torch.tensor([1, 1, 0.9, 0.5]))


# --------------------------------------------------------------------------------------------- GSPO and CISPO


def test_gspo_on_worked_numbers():
    # Response 0: token log-ratios 0.1, 0.3 → s = e^0.2 = 1.2214, A = 1 → clipped at 1 + 0.1: −1.1 on each token, no
    # gradient. Response 1: log-ratios −0.3, 0, 0 → s = e^−0.1 = 0.9048 (inside), A = −1 → 0.9048 on each token.
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.3, 0.0], [-0.3, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([[1.0] * 3, [-1.0] * 3])
    loss, stats = ppo.gspo_loss(
        logp, old, advantages, mask, gspo_clip_low=0.1, gspo_clip_high=0.1, agg="seq-mean-token-mean"
    )
    s1 = math.exp(-0.1)
    assert loss.item() == pytest.approx((-1.1 + s1) / 2, rel=1e-6)
    loss.backward()
    assert (logp.grad[0] == 0).all()
    # d/dlogp_t of ½ · mean_t(−A·s) = ½ · ⅓ · s on every token of response 1 (∂s/∂logp_t = s/3 through the mean)
    assert torch.allclose(logp.grad[1], torch.full((3,), s1 / 6), rtol=1e-6)
    assert stats.clip_frac.item() == pytest.approx(2 / 5)


@pytest.mark.parametrize("seed", range(3))
def test_gspo_token_form_has_the_sequence_objectives_gradient(seed):
    """The paper's objective, one clipped ratio per response computed directly, written as a loop over responses:
    the token form (value and gradient) must agree with it."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 2, 7, 4]
    mask = (torch.arange(7) < torch.tensor(lengths)[:, None]).float()
    old = torch.randn(4, 7, generator=g) * mask
    start = (old + 0.02 * torch.randn(4, 7, generator=g)) * mask
    scores = torch.randn(4, generator=g)
    advantages = scores[:, None].expand(4, 7)
    token_form = start.clone().requires_grad_(True)
    loss, _ = ppo.gspo_loss(token_form, old, advantages, mask, 0.003, 0.004, agg="seq-mean-token-mean")
    loss.backward()
    sequence_form = start.clone().requires_grad_(True)
    total = 0.0
    for i, n in enumerate(lengths):
        s = torch.exp((sequence_form[i, :n] - old[i, :n]).mean())
        total = total + torch.maximum(-scores[i] * s, -scores[i] * s.clamp(1 - 0.003, 1 + 0.004))
    (total / len(lengths)).backward()
    assert loss.item() == pytest.approx(total.item() / len(lengths), rel=1e-5)
    assert torch.allclose(token_form.grad, sequence_form.grad, atol=1e-7)


def test_cispo_clips_the_weight_not_the_gradient():
    # token 0: ratio 1.5, A = 1 → weight clipped to 1.2, gradient −1.2 (PPO's clip would give it none);
    # token 1: ratio 0.9 (inside), A = −2 → gradient +2·0.9; over 2 tokens (token-mean).
    logp, old, adv, mask = _ratio_setup([1.5, 0.9], [1.0, -2.0])
    loss, stats = ppo.cispo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert torch.allclose(logp.grad[0], torch.tensor([-1.2 / 2, 2 * 0.9 / 2]), rtol=1e-6)
    assert loss.item() == pytest.approx((-1.2 * math.log(1.5) + 2 * 0.9 * math.log(0.9)) / 2, rel=1e-6)
    assert stats.clip_frac.item() == pytest.approx(0.5)
    ppo_loss, _ = ppo.policy_loss(logp.detach().requires_grad_(True), old, adv, mask)
    assert ppo_loss.item() != loss.item()


# verl's policy losses, as written at commit b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29) of
# volcengine/verl, verl/trainer/ppo/core_algos.py: compute_policy_loss_gspo and compute_policy_loss_cispo, their
# arithmetic transcribed without the config plumbing (Apache-2.0).
def verl_gspo(old_log_prob, log_prob, advantages, response_mask, low, high):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(torch.clamp(log_seq_importance_ratio, max=10.0))
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    per_sequence = (pg_losses * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)  # seq-mean-token-mean
    return per_sequence.mean()


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, low, high):
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    pg_losses = -torch.clamp(ratio, 1 - low, 1 + high).detach() * advantages * log_prob
    return (pg_losses * response_mask).sum() / response_mask.sum()  # token-mean


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_gspo_and_cispo_match_verl(loss, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (6,), generator=g)
    mask = (torch.arange(8) < lengths[:, None]).float()
    old = -torch.rand(6, 8, generator=g) * 3
    start = old + 0.3 * torch.randn(6, 8, generator=g)  # ratios from about 0.4 to 2.5: some clipped, some not
    advantages = torch.randn(6, 1, generator=g).expand(6, 8)
    low, high = (0.003, 0.004) if loss == "gspo" else (0.2, 0.28)
    ours_in, verl_in = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
    if loss == "gspo":
        ours, _ = ppo.gspo_loss(ours_in, old, advantages, mask, low, high, agg="seq-mean-token-mean")
        theirs = verl_gspo(old, verl_in, advantages, mask, low, high)
    else:
        ours, _ = ppo.cispo_loss(ours_in, old, advantages, mask, low, high, agg="token-mean")
        theirs = verl_cispo(old, verl_in, advantages, mask, low, high)
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) < 5e-7
    assert torch.allclose(ours_in.grad, verl_in.grad, atol=5e-7)
