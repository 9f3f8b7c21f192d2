"""Multi-turn episodes: the environment's tokens are context, never trained. Every stage honours the response mask:
the scorer's reference log-probs, the advantage stage's KL, rewards, values and advantages, the learner's losses and
its metrics."""

import copy
import dataclasses
import json
import time

import numpy as np
import pytest
import torch

from common import ppo
from common.config import AlgorithmSection
from common.sequences import pack, response_logprobs, response_values
from services.advantage import AdvantageService
from services.advantage.estimation import estimate_advantages
from services.environment.base import Environment, Step
from services.feeder import FeederService
from services.generator import GeneratorService
from services.learner.experience import Experience
from services.learner.trainer import PPOTrainer
from services.scorer import ScorerService

# An episode of 6 response tokens: the model's turn (2 tokens), the environment's answer (2), the model's last turn.
MODEL = torch.tensor([[True, True, False, False, True, True]])


def test_gae_skips_the_environments_tokens_worked_numbers():
    # The model's tokens carry KL 0.1, 0.2, 0.0, 0.1 and values 0.5, 0.4, 0.3, 0.2; the environment's tokens carry
    # nonsense (their log-probs and values must not count). β = 0.5, score 1, γ = λ = 1:
    #   rewards r = −β·kl = −0.05, −0.1, 0, −0.05 + 1 = 0.95 on the model's tokens, 0 on the environment's;
    #   A_t = Σ_{k ≥ t} r_k − V_t over the model's tokens: 0.8 − 0.5, 0.85 − 0.4, 0.95 − 0.3, 0.95 − 0.2;
    #   returns = A + V = 0.8, 0.85, 0.95, 0.95.
    ref = torch.tensor([[-1.0, -1.0, -9.0, 7.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-0.9, -0.8, 3.0, -5.0, -1.0, -0.9]])
    values = torch.tensor([[0.5, 0.4, 0.3, 0.2, 0.3, 0.2]])  # the critic's values, before masking
    algorithm = AlgorithmSection(estimator="gae", gamma=1.0, lam=1.0, kl_estimator="k1", whiten_advantages=False)
    mask = MODEL.float()
    est = estimate_advantages(
        torch.tensor([1.0]),
        behaviour * mask,
        ref * mask,
        torch.tensor([[0.5, 0.4, 0.0, 0.0, 0.3, 0.2]]),
        mask,
        torch.tensor([True]),
        torch.tensor([0]),
        algorithm,
        kl_coef=0.5,
        max_new_tokens=6,
    )
    torch.testing.assert_close(est.kl, torch.tensor([[0.1, 0.2, 0.0, 0.0, 0.0, 0.1]]))
    torch.testing.assert_close(est.token_rewards, torch.tensor([[-0.05, -0.1, 0.0, 0.0, 0.0, 0.95]]))
    torch.testing.assert_close(est.advantages, torch.tensor([[0.3, 0.45, 0.0, 0.0, 0.65, 0.75]]))
    torch.testing.assert_close(est.returns, torch.tensor([[0.8, 0.85, 0.0, 0.0, 0.95, 0.95]]))
    assert values.shape == est.advantages.shape


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_pp"])
def test_an_estimators_advantages_are_those_of_the_model_tokens_alone(estimator):
    """An episode's advantages at the model's tokens are exactly those of the same tokens without the
    environment's between them; at the environment's tokens they are 0."""
    g = torch.Generator().manual_seed(0)
    n, width = 4, 9
    lengths = torch.tensor([9, 7, 5, 8])
    real = torch.arange(width) < lengths[:, None]
    model = real & ~((torch.arange(width) >= 2) & (torch.arange(width) < 4))  # positions 2 and 3: the environment's
    behaviour, ref = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)
    values = torch.randn(n, width, generator=g)
    scores, group = torch.tensor([1.0, 0.0, 0.5, 0.2]), torch.tensor([0, 0, 1, 1])
    algorithm = AlgorithmSection(estimator=estimator, kl_in="reward", kl_coef=0.1, whiten_advantages=False)

    def run(mask, b, r, v):
        m = mask.float()
        return estimate_advantages(
            scores, b * m, r * m, v * m, m, torch.ones(n, dtype=torch.bool), group, algorithm, 0.1, width
        )

    episode = run(model, behaviour, ref, values)
    # The same responses with the environment's tokens taken out.
    alone_mask = torch.arange(width) < model.sum(1, keepdim=True)
    alone = run(alone_mask, *(left_aligned(x, model) for x in (behaviour, ref, values)))
    for name in ("kl", "token_rewards", "advantages", "returns"):
        got, want = getattr(episode, name), getattr(alone, name)
        assert (got[~model] == 0).all(), f"{name} at the environment's tokens"
        torch.testing.assert_close(got[model], want[alone_mask], msg=name)


def left_aligned(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``(N, T)``: each row's entries where ``keep``, moved to its start (zeros after)."""
    return torch.stack([torch.cat([row[k], row.new_zeros(int((~k).sum()))]) for row, k in zip(x, keep)])


def packed(message, pad_token_id: int):
    """``message``'s prompts and whole responses (the environment's tokens included) as one batch of sequences."""
    return pack(
        torch.from_numpy(message.prompt_tokens),
        torch.from_numpy(message.prompt_lengths),
        torch.from_numpy(message.response_tokens),
        torch.from_numpy(message.response_lengths),
        pad_token_id,
    )


def as_episode(message, at: int, observation: list[int]):
    """``message`` (rollouts or scored) with ``observation`` spliced into every response after its first ``at``
    tokens: an environment's answer between two model turns. Arrays of the environment's positions are 0."""
    width = message.response_tokens.shape[1] + len(observation)
    fields = {}
    rows = []
    for i in range(message.rows):
        length = int(message.response_lengths[i])
        assert length > at, "every response needs a second turn"
        rows.append((length, np.r_[np.arange(at), np.arange(at, length) + len(observation)]))
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if isinstance(value, np.ndarray) and value.ndim == 2 and f.name not in ("prompt_tokens",):
            spliced = np.zeros((message.rows, width), dtype=value.dtype)
            for i, (length, positions) in enumerate(rows):
                spliced[i, positions] = value[i, :length]
                if f.name == "response_tokens":
                    spliced[i, at : at + len(observation)] = observation
            value = spliced
        fields[f.name] = value
    episode = type(message)(**fields)
    episode.response_lengths = message.response_lengths + len(observation)
    episode.turns = np.full(message.rows, 2)
    return episode


@pytest.fixture
def scored_episode(make_config):
    """A real generator's responses to the vowels prompts made into episodes, scored by the real scorer."""
    config = make_config(
        "data.batch_size=2", "generation.n=2", "generation.max_new_tokens=8", "learner.mini_batch_size=4"
    )
    rollouts = GeneratorService(config).process(FeederService(config).batch(0))[0]
    keep = rollouts.response_lengths > 3
    rollouts = rollouts.take_rows(keep)
    episode = as_episode(rollouts, at=2, observation=[5, 6, 7])
    return config, episode, ScorerService(config).process(episode)[0]


def test_the_scorer_gives_reference_log_probs_of_the_model_tokens_in_their_context(scored_episode):
    config, episode, scored = scored_episode
    scorer = ScorerService(config)
    tokens = torch.from_numpy(episode.response_tokens)
    with torch.no_grad():
        whole, _ = response_logprobs(
            scorer.reference, packed(episode, scorer.pad_token_id), tokens, config.generation.temperature
        )
    mask = episode.response_mask
    assert (scored.ref_logprobs[~mask] == 0).all(), "no reference log-prob for the environment's tokens"
    np.testing.assert_allclose(scored.ref_logprobs[mask], whole.numpy()[mask], atol=1e-5)
    assert (scored.ref_logprobs[mask] != 0).all()


def test_the_advantage_stage_sees_the_environments_tokens_as_context_only(scored_episode):
    config, episode, scored = scored_episode
    service = AdvantageService(config)
    (experience,) = service.process(scored)
    mask = experience.response_mask
    for name in ("values", "kl", "token_rewards", "advantages", "returns"):
        assert (getattr(experience, name)[~mask] == 0).all(), name
    # The critic read the environment's tokens: its value after them is that of the whole sequence.
    with torch.no_grad():
        values = response_values(service.critic, packed(experience, service.pad_token_id))
    np.testing.assert_allclose(experience.values[mask], values.numpy()[:, : mask.shape[1]][mask], atol=1e-5)
    # Nonsense at the environment's positions of the scored record changes nothing.
    noisy = copy.deepcopy(scored)
    noisy.behaviour_logprobs[~mask], noisy.ref_logprobs[~mask] = -7.0, 3.0
    (again,) = AdvantageService(config).process(noisy)
    for name in ("kl", "token_rewards", "advantages", "returns"):
        np.testing.assert_array_equal(getattr(again, name), getattr(experience, name), err_msg=name)
    # GAE runs over the model's tokens alone: the record's advantages are those of its model tokens left-aligned.
    m = torch.from_numpy(mask)
    alone_mask = torch.arange(m.shape[1]) < m.sum(1, keepdim=True)
    rewards, values = (left_aligned(torch.from_numpy(getattr(experience, n)), m) for n in ("token_rewards", "values"))
    want, _ = ppo.gae(rewards, values, alone_mask, config.algorithm.gamma, config.algorithm.lam)
    np.testing.assert_allclose(experience.advantages[mask], want[alone_mask].numpy(), atol=1e-6)


@pytest.mark.parametrize("example", ["config.yaml", "grpo.yaml"], ids=["ppo", "grpo-kl-in-loss"])
def test_the_environments_tokens_change_no_loss(make_config, example):
    """One update on an episode, and on the same episode with nonsense at the environment's positions of every
    experience field: the same weights after it. Marking those tokens as the model's instead changes them."""
    config = make_config(
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=8",
        "learner.mini_batch_size=4",
        example=example,
    )
    rollouts = GeneratorService(config).process(FeederService(config).batch(0))[0]
    rollouts = rollouts.take_rows(rollouts.response_lengths > 3)
    episode = as_episode(rollouts, at=2, observation=[5, 6, 7])
    (experience,) = AdvantageService(config).process(ScorerService(config).process(episode)[0])
    exp = Experience.from_message(experience)
    env = ~exp.response_mask & (torch.arange(exp.response_tokens.shape[1]) < exp.response_lengths[:, None])
    assert env.sum() == 3 * exp.rows
    noisy = dataclasses.replace(
        exp,
        **{
            name: torch.where(env, torch.full_like(getattr(exp, name), fill), getattr(exp, name))
            for name, fill in (
                ("behaviour_logprobs", -4.0),
                ("ref_logprobs", 2.0),
                ("kl", 5.0),
                ("values", 9.0),
                ("advantages", 3.0),
                ("returns", -6.0),
            )
        },
    )
    as_models = dataclasses.replace(noisy, response_mask=noisy.response_mask | env)

    def trained(batch):
        from common.models import load_actor, load_critic, resolve_model

        path = resolve_model(config.model.actor, config.model.cache_dir)
        algorithm = config.algorithm
        trainer = PPOTrainer(
            load_actor(path),
            load_critic(path) if algorithm.uses_critic else None,
            config.learner,
            algorithm,
            temperature=config.generation.temperature,
            pad_token_id=GeneratorService(config).tokenizer.pad_token_id,
            max_response_length=config.generation.max_new_tokens,
        )
        torch.manual_seed(0)
        stats = trainer.train(batch)
        return [p.detach().clone() for p in trainer.actor.parameters()], stats

    base, stats = trained(exp)
    same, _ = trained(noisy)
    other, _ = trained(as_models)
    assert all(torch.equal(a, b) for a, b in zip(base, same)), "the environment's tokens changed the update"
    assert not all(torch.equal(a, b) for a, b in zip(base, other)), "the test cannot tell the mask's effect"
    assert stats["response_length"] == pytest.approx(float(exp.response_mask.sum(1).float().mean()))


# --------------------------------------------------------------------------------------------- the episode loop


class Counter(Environment):
    """Ends a model turn at the letter 'a' (the tiny character model writes it often) and answers with the turn's
    number; done after its second answer. Reward 0.5 per step."""

    stop = ("a",)

    def reset(self, prompt: str, label: str) -> None:
        self.steps = 0

    def step(self, turn: str) -> Step:
        self.steps += 1
        return Step(observation=f" {self.steps} ", reward=0.5, done=self.steps >= 2)


class Broken(Counter):
    def step(self, turn: str) -> Step:
        raise RuntimeError("the environment broke")


class Silent(Counter):
    def step(self, turn: str) -> Step:
        time.sleep(5)
        return super().step(turn)


def episode_config(make_config, environment: str, *overrides: str):
    return make_config(
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=12",
        "learner.mini_batch_size=4",
        f"environment.name=test_episodes:{environment}",
        "environment.placement=local",
        *overrides,
    )


def sampled_episodes(config, streaming: bool):
    """The generator's records for prompt batch 0, and the generator."""
    generator = GeneratorService(config)
    message = FeederService(config).batch(0)
    if not streaming:
        return generator.process(message), generator
    generator.admit(message)
    records = []
    while generator.under_way() or generator.queue:
        records += [record for collected in generator.collect() for record in collected.outputs]
    return records, generator


def observation_runs(tokens: list[int], models: np.ndarray) -> list[list[int]]:
    """The runs of tokens that are not the model's, in order."""
    runs, previous = [], True
    for token, model in zip(tokens, models):
        if not model:
            runs.append([token]) if previous else runs[-1].append(token)
        previous = model
    return runs


@pytest.mark.parametrize("streaming", [False, True], ids=["batch", "streaming"])
def test_an_episode_is_the_models_tokens_and_the_environments_appended_as_tokens(make_config, streaming):
    config = episode_config(make_config, "Counter", "environment.max_turns=3", f"generation.streaming={streaming}")
    records, generator = sampled_episodes(config, streaming)
    assert sum(record.rows for record in records) == 4
    tokenizer = generator.tokenizer
    observations = [tokenizer(f" {n} ", add_special_tokens=False).input_ids for n in (1, 2)]
    with_turns = 0
    for rollouts in records:
        for i in range(rollouts.rows):
            length = int(rollouts.response_lengths[i])
            models = rollouts.response_mask[i, :length]
            turns = int(rollouts.turns[i])
            runs = observation_runs(rollouts.response_tokens[i, :length].tolist(), models)
            # The environment's tokens are exactly its observations, each tokenized alone, one after each turn
            # that stopped (the last may have run out of tokens).
            assert runs == observations[: len(runs)] and len(runs) in (turns - 1, turns) and 1 <= turns <= 3
            assert rollouts.environment_reward[i] == pytest.approx(0.5 * len(runs))
            assert bool(rollouts.finished[i]) == (len(runs) == 2), "done after the second answer"
            assert (rollouts.behaviour_logprobs[i, :length][~models] == 0).all()
            assert (rollouts.behaviour_logprobs[i, :length][models] < 0).all()
            with_turns += turns > 1
        # Token in, token out: one forward pass over the prompt and every token gives the model's tokens the
        # log-probs the sampler gave them turn by turn (the observations were context, nothing re-tokenised).
        with torch.no_grad():
            logp, _ = response_logprobs(
                generator.sampler.model,
                packed(rollouts, tokenizer.pad_token_id),
                torch.from_numpy(rollouts.response_tokens),
                config.generation.temperature,
            )
        mask = rollouts.response_mask
        np.testing.assert_allclose(logp.numpy()[mask], rollouts.behaviour_logprobs[mask], atol=2e-4)
    assert with_turns, "no episode had a second turn: the test shows nothing"


@pytest.mark.parametrize("environment", ["Broken", "Silent"])
def test_an_environment_that_fails_or_never_answers_ends_its_episode_truncated(make_config, environment):
    config = episode_config(
        make_config, environment, "environment.turn_timeout_s=0.5", "environment.timeout_reward=-1.0"
    )
    (rollouts,), generator = sampled_episodes(config, streaming=False)
    assert not rollouts.finished.any() and (rollouts.turns == 1).all()
    assert not (~rollouts.response_mask & (rollouts.response_tokens != generator.tokenizer.pad_token_id)).any()
    # A turn that stopped was stepped: a silent environment's episode gets timeout_reward, a broken one's nothing.
    eos = generator.tokenizer.eos_token_id
    last = rollouts.response_tokens[np.arange(rollouts.rows), np.maximum(rollouts.response_lengths - 1, 0)]
    stopped = np.array([text.rstrip().endswith("a") for text in rollouts.response_text]) | (last == eos)
    assert stopped.any(), "no turn stopped at the environment's stop string: the test shows nothing"
    want = -1.0 if environment == "Silent" else 0.0
    assert (rollouts.environment_reward[stopped] == want).all() and (rollouts.environment_reward[~stopped] == 0).all()
    generator.close()


def test_the_scorer_adds_the_environments_reward(make_config):
    config = episode_config(
        make_config, "Counter", "reward.function=recipes.rewards:no_score", "reward.environment_weight=2.0"
    )
    (rollouts,), _ = sampled_episodes(config, streaming=False)
    (scored,) = ScorerService(config).process(rollouts)
    assert rollouts.environment_reward.any(), "no episode got a reward from its environment: the test shows nothing"
    np.testing.assert_allclose(scored.scores, 2.0 * rollouts.environment_reward)
    assert scored.lineage["reward.environment_weight"] == 2.0


def test_an_embedded_run_trains_on_episodes(make_config):
    from services.launch.embedded import run_embedded

    config = episode_config(make_config, "Counter", "run.steps=3", "environment.max_turns=3")
    run_embedded(config, progress=False)
    lines = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    # The learner's response length counts the model's tokens: below the real tokens once an episode had a turn.
    assert all(0 < line["response_length"] <= config.max_response_tokens for line in lines)
    # Episode statistics: turns after an answered turn, and the Counter's 0.5 per answer.
    assert all(1 <= line["turns_mean"] <= 3 for line in lines) and any(line["turns_mean"] > 1 for line in lines)
    assert any(line["environment_reward_mean"] > 0 for line in lines)


def test_an_embedded_run_with_the_environment_as_a_role_on_the_bus(make_config):
    from helpers import read_messages

    from services.launch.embedded import run_embedded
    from services.transport.memory import MemoryBus

    config = episode_config(
        make_config,
        "Counter",
        "run.steps=2",
        "environment.max_turns=3",
        "environment.placement=bus",
        "generation.streaming=true",
    )
    bus = MemoryBus()
    run_embedded(config, progress=False, bus=bus)
    turns, replies = read_messages(bus, "turns"), read_messages(bus, "observations")
    assert turns and len(replies) == len(turns), "every turn asked was answered once"
    for turn, reply in zip(
        sorted(turns, key=lambda t: (t.episode, t.turn)), sorted(replies, key=lambda r: (r.episode, r.turn))
    ):
        assert (reply.episode, reply.turn, reply.reply_to) == (turn.episode, turn.turn, turn.reply_to)
        assert reply.observation == f" {turn.turn + 1} " and reply.done == (turn.turn == 1)
        assert reply.producer == "environment-0" and reply.status == "ok"
        assert len(turn.model_turns) == turn.turn + 1 and len(turn.observations) == turn.turn
    experience = read_messages(bus, "experience")
    answered = {turn.episode for turn in turns}
    rewards = {f"{e.step}/{int(e.group_index[i])}": e.environment_reward[i] for e in experience for i in range(e.rows)}
    assert rewards and max(rewards.values()) > 0 and len(answered) >= 1


def test_a_turn_timeout_counts_only_the_time_the_generator_waits(make_config):
    """The embedded run gives each service its turn in order, and a process may be busy loading weights: the time a
    generator spends away from its episodes moves their deadlines, so an environment is not timed out for it."""
    from common.models import load_tokenizer, resolve_model
    from common.sampling import SamplingParams
    from services.generator.episodes import AWAY_S, EpisodeSampler
    from services.generator.samplers import make_sampler

    config = episode_config(make_config, "Silent", "environment.turn_timeout_s=30")
    path = resolve_model(config.model.actor, config.model.cache_dir)
    tokenizer = load_tokenizer(path)
    episodes = EpisodeSampler(make_sampler(config, path, tokenizer), tokenizer, config, lambda: 0)
    message = FeederService(config).batch(0)
    for row in range(message.rows):
        prompt = message.prompt_tokens[row, : int(message.prompt_lengths[row])].tolist()
        episodes.submit(f"g{row}", prompt, SamplingParams(n=2, max_new_tokens=12, seed=row), message, row)
    while episodes.sampler.in_flight():
        episodes.step(0.05)
    assert episodes.waiting, "no turn stopped at the environment's stop string: the test shows nothing"
    before = {id_: episode.deadline for id_, episode in episodes.waiting.items()}
    time.sleep(AWAY_S + 0.5)  # away: another service's turn
    episodes.step(0.0)
    for id_, episode in episodes.waiting.items():
        assert episode.deadline - before[id_] >= AWAY_S + 0.5
    episodes.close()
