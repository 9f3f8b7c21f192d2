"""The algorithm's variants are declared once (common/algorithms.py): the functions registered in common/ppo.py, the
configuration's choices and its cross-field checks all follow the declarations."""

import inspect
import json
import math

import pytest
import torch

from common import algorithms, ppo
from common.algorithms import ESTIMATORS, KINDS, Variant
from common.config import ConfigError

REGISTRIES = {
    algorithms.ESTIMATORS: ppo.ADVANTAGE_ESTIMATORS,
    algorithms.POLICY_LOSSES: ppo.POLICY_LOSSES,
    algorithms.LOSS_AGGREGATIONS: ppo.LOSS_AGGREGATIONS,
    algorithms.KL_ESTIMATORS: ppo.KL_ESTIMATORS,
}


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.setting)
def test_every_declared_variant_has_a_function_given_exactly_its_settings(kind):
    registry = REGISTRIES[kind]
    assert sorted(registry) == sorted(kind.variants), "every declared variant registered, and only those"
    if kind in (algorithms.ESTIMATORS, algorithms.POLICY_LOSSES):
        inputs = {"x"} if kind is algorithms.ESTIMATORS else {"logp", "old_logp", "advantages", "mask"}
        context = {"importance_weights", "agg", "num_tokens", "norm_length"}
        for name, fn in registry.items():
            parameters = set(inspect.signature(fn).parameters) - inputs - context
            assert parameters == set(kind[name].reads), (name, parameters)


def test_a_function_for_an_undeclared_variant_is_refused():
    with pytest.raises(ValueError, match="unknown advantage estimator 'nameless'; choose one of gae, grpo"):
        ppo.register_advantage_estimator("nameless")(lambda x: (x.mask, x.mask))
    with pytest.raises(ValueError, match="already registered"):
        ppo.register_advantage_estimator("grpo")(lambda x: (x.mask, x.mask))


def test_the_config_takes_its_choices_and_checks_from_the_declarations(make_config):
    for name, variant in ESTIMATORS.variants.items():
        example = "config.yaml" if variant.uses_critic else "grpo.yaml"
        kl_in = ["algorithm.kl_in=reward"] if variant.needs_kl_in_reward else []  # grpo.yaml has it in the loss
        config = make_config(f"algorithm.estimator={name}", *kl_in, example=example)
        assert config.algorithm.uses_critic == variant.uses_critic
    with pytest.raises(ConfigError, match="algorithm.lam is set, but no chosen variant reads it"):
        make_config("algorithm.estimator=reinforce_pp", "algorithm.lam=0.9", example="grpo.yaml")
    with pytest.raises(ConfigError, match="algorithm.gamma is set, but no chosen variant reads it"):
        make_config("algorithm.gamma=0.9", example="grpo.yaml")
    assert make_config("algorithm.estimator=reinforce_pp", "algorithm.gamma=0.9", example="grpo.yaml")
    with pytest.raises(ConfigError, match="learner.policy_loss: Value error, unknown policy loss 'sapo'"):
        make_config("learner.policy_loss=sapo")
    assert make_config("learner.policy_loss=gspo", "learner.gspo_clip_high=0.001").learner.gspo_clip_high == 0.001
    with pytest.raises(ConfigError, match="learner.clip_low is set, but no chosen variant reads it"):
        make_config("learner.policy_loss=gspo", "learner.clip_low=0.1")  # GSPO's ε are its own
    with pytest.raises(ConfigError, match="learner.gspo_clip_low is set, but no chosen variant reads it"):
        make_config("learner.policy_loss=cispo", "learner.gspo_clip_low=0.1")


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_the_learner_trains_with_the_chosen_policy_loss_and_its_settings(loss, make_config, monkeypatch):
    from services.launch.embedded import run_embedded

    calls = []
    chosen = ppo.POLICY_LOSSES[loss]

    def recorded(*args, **kwargs):
        calls.append(kwargs)
        return chosen(*args, **kwargs)

    monkeypatch.setitem(ppo.POLICY_LOSSES, loss, recorded)
    clip = {"gspo": "learner.gspo_clip_high=0.002", "cispo": "learner.clip_high=0.28"}[loss]
    config = make_config(f"learner.policy_loss={loss}", clip, "run.steps=1", "data.eval_prompts=0", example="grpo.yaml")
    run_embedded(config, progress=False)
    assert calls, "the learner called the chosen loss"
    setting, value = clip.removeprefix("learner.").split("=")
    assert all(call[setting] == float(value) for call in calls)
    record = json.loads((config.run.dir / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(record["policy_loss"])


@pytest.fixture
def sign_estimator(monkeypatch):
    """A throwaway estimator added as any estimator is: its function and its declaration, nothing else.

    ``sign``: every token of response ``i`` gets ``sign(s_i − mean_g)``, and the call's shapes are recorded."""
    calls = []
    monkeypatch.setitem(
        ESTIMATORS.variants, "sign", Variant("sign", "sign(s_i − mean_g) on every token", needs_groups=True)
    )

    @ppo.register_advantage_estimator("sign")
    def sign(x: ppo.EstimatorInput):
        scores = (x.token_rewards * x.mask).sum(dim=-1)
        mean, _, _ = ppo.group_mean_std(scores, x.group_index)
        advantages = torch.sign(scores - mean).unsqueeze(-1) * x.mask
        calls.append((advantages, x.mask))
        return advantages, advantages

    yield calls
    del ppo.ADVANTAGE_ESTIMATORS["sign"]


def test_a_new_estimator_is_its_function_and_its_declaration(sign_estimator, make_config):
    """The config accepts it, applies the checks its declaration implies, and a run trains with it."""
    from services.launch.embedded import run_embedded

    with pytest.raises(ConfigError, match="learner.critic_lr.* which runs without a critic"):
        make_config("algorithm.estimator=sign")  # the PPO example sets critic settings
    with pytest.raises(ConfigError, match="generation.n must be at least 2"):
        make_config("algorithm.estimator=sign", "generation.n=1", "learner.mini_batch_size=8", example="grpo.yaml")
    config = make_config(
        "algorithm.estimator=sign",
        "run.steps=2",
        "data.batch_size=4",
        "learner.mini_batch_size=8",
        "data.eval_prompts=0",
        example="grpo.yaml",
    )
    assert not config.algorithm.uses_critic
    run_embedded(config, progress=False)
    records = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").open()]
    assert len(records) == len(sign_estimator) == 2
    for record, (advantages, mask) in zip(records, sign_estimator):
        assert set(advantages[mask.bool()].tolist()) <= {-1.0, 0.0, 1.0}
        # What the learner trained on is what the estimator made.
        assert record["advantage_mean"] == pytest.approx(float(ppo.masked_mean(advantages, mask)), abs=1e-6)
        assert "value_loss" not in record, "no critic anywhere"


def test_overlong_shaping_reaches_the_advantages():
    """The advantage stage shapes each score by its response's length before the estimator sees it: with Dr. GRPO
    the advantages are the shaped scores less their group's mean."""
    from common.config import AlgorithmSection
    from services.advantage.estimation import estimate_advantages

    lengths = torch.tensor([4, 7, 8, 8])  # limit 8, buffer 2: penalties 0, 0.5, 1, 1
    mask = (torch.arange(8) < lengths[:, None]).float()
    zeros = torch.zeros(4, 8)
    algorithm = AlgorithmSection(estimator="dr_grpo", overlong_buffer=2, kl_coef=0.0)
    est = estimate_advantages(
        torch.ones(4), zeros, zeros, zeros, mask, torch.ones(4, dtype=torch.bool), torch.tensor([0, 0, 1, 1]),
        algorithm, 0.0, max_new_tokens=8,
    )  # fmt: skip
    assert torch.allclose(est.advantages[:, 0], torch.tensor([0.25, -0.25, 0.0, 0.0]))


def test_distill_gives_each_token_its_own_reward_as_its_advantage_whitened():
    rewards = torch.tensor([[-0.2, 0.1, 0.5], [0.3, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    advantages, returns = ppo.token_own_rewards(rewards, mask)
    assert torch.equal(returns, torch.tensor([[-0.2, 0.1, 0.5], [0.3, 0.0, 0.0]]))  # no discount, no sum
    real = torch.tensor([-0.2, 0.1, 0.5, 0.3])  # mean 0.175, Bessel std 0.2986
    expected = (real - real.mean()) / torch.sqrt(real.var(unbiased=True) + 1e-8)
    assert torch.allclose(advantages[mask.bool()], expected, atol=1e-6) and (advantages[1, 1:] == 0).all()


def test_on_policy_distillation_moves_the_student_toward_its_teacher(make_config, tiny_model, tmp_path):
    """The reference slot holds a teacher, the signal is the per-token reverse KL to it (k1 in the rewards, β 1, no
    score): over the run the student's KL to the teacher falls. The teacher is the tiny model with its final norm's
    weights × 6, so logits × 6: a much sharper distribution (reverse KL about 2.4 nats a token at the start) that
    the student can reach."""
    from common.models import load_actor, load_tokenizer
    from services.launch.embedded import run_embedded

    teacher = load_actor(tiny_model)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(6.0)
    teacher.save_pretrained(tmp_path / "teacher")
    load_tokenizer(tiny_model).save_pretrained(tmp_path / "teacher")
    with pytest.raises(ConfigError, match="algorithm.kl_in must be reward"):
        make_config("algorithm.estimator=distill", example="grpo.yaml")  # its KL is in the loss
    config = make_config(
        "algorithm.estimator=distill",
        "algorithm.kl_in=reward",
        "algorithm.kl_estimator=k1",
        "algorithm.kl_coef=1.0",
        "reward.function=recipes.rewards:no_score",
        f"model.reference={tmp_path / 'teacher'}",
        "run.steps=16",
        "data.eval_prompts=0",
        example="grpo.yaml",
    )
    run_embedded(config, progress=False)
    kl = [json.loads(line)["kl"] for line in (config.run.dir / "metrics.jsonl").open()]
    first, last = sum(kl[:4]) / 4, sum(kl[-4:]) / 4
    assert first > 1.0 and last < 0.2 * first, kl  # measured: 2.15 → 0.03
