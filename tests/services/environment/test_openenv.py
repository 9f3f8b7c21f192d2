"""OpenEnv environments served through the adapter (services/environment/adapters.py): the model's turn becomes the
environment's action, its observation the episode's next tokens, its reward and done the episode's; a replica that
takes an episode up replays it to the same state (the seed is the row's)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from openenv.core.env_server.interfaces import Environment as OpenEnv
from openenv.core.env_server.types import Action, Observation, State

from common.config import ConfigError
from common.schema import EpisodeTurn, new_header
from services.environment.adapters import OpenEnvEnvironment, openenv_seed
from services.environment.base import load_environment
from services.environment.service import EnvironmentService

# ------------------------------------------------------------------------------- environments as OpenEnv writes them


class Say(Action):
    text: str


class Heard(Observation):
    heard: str = ""


class Counting(OpenEnv[Say, Heard, State]):
    """test_episodes' Counter as an OpenEnv environment: answers each turn with its number, done after the second;
    reward ``reward`` per step. Keeps what it was given, for the tests to read."""

    def __init__(self, reward: float = 0.5):
        super().__init__()
        self.reward, self.actions, self.resets, self.closed = reward, [], [], False

    def reset(self, seed=None, episode_id=None, **kwargs) -> Heard:
        self.resets.append({"seed": seed, **kwargs})
        self.count = 0
        return Heard(heard="ready")

    def step(self, action: Say, timeout_s=None, **kwargs) -> Heard:
        self.actions.append(action)
        self.count += 1
        return Heard(heard=f" {self.count} ", reward=self.reward, done=self.count >= 2)

    @property
    def state(self) -> State:
        return State(step_count=self.count)

    def close(self) -> None:
        self.closed = True


class Dealer(OpenEnv):
    """Deals a card from a deck shuffled by the reset's seed at each turn (its step is not annotated: the action
    type comes from the config); reset takes no prompt."""

    def reset(self, seed=None, episode_id=None) -> Heard:
        self.deck = list(range(52))
        random.Random(seed).shuffle(self.deck)
        return Heard()

    def step(self, action, timeout_s=None, **kwargs) -> Heard:
        return Heard(heard=f"card {self.deck.pop()}", done=not self.deck)

    @property
    def state(self) -> State:
        return State()


class Move(Action):
    piece: str
    square: str


class Board(Observation):
    position: str = ""
    captured: int = 0


class Chess(OpenEnv[Move, Board, State]):
    """An action of two fields (the turn must be parsed) and an observation of two (shown as JSON)."""

    def reset(self, seed=None, episode_id=None, **kwargs) -> Board:
        return Board()

    def step(self, action: Move, timeout_s=None, **kwargs) -> Board:
        return Board(position=f"{action.piece}@{action.square}", captured=1, reward=1.0, done=True)

    @property
    def state(self) -> State:
        return State()


def parse_move(text: str) -> Move:
    piece, _, square = text.strip().partition(" ")
    return Move(piece=piece, square=square)


def openenv_config(make_config, environment: str, *overrides: str):
    """A config with ``environment`` ('module:Class', or a class of this module) served through the adapter."""
    return make_config(
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=12",
        "learner.mini_batch_size=4",
        "environment.placement=local",
        f"environment.openenv.environment={environment if ':' in environment else f'test_openenv:{environment}'}",
        *overrides,
    )


# ------------------------------------------------------------------------------------------------------- the adapter


def test_a_turn_is_the_environments_action_and_its_observation_the_episodes_text(make_config):
    config = openenv_config(
        make_config, "Counting", "environment.openenv.kwargs={reward: 0.25}", "environment.openenv.stop=[a]"
    )
    assert config.environment.name == "services.environment.adapters:OpenEnvEnvironment", "openenv names its adapter"
    assert load_environment(config.environment).stops(config.environment) == ("a",)
    env = OpenEnvEnvironment(config.environment)
    env.reset("What is 2+3?", "5")
    # The seed is the row's; the prompt and label go where reset takes them.
    assert env.environment.resets == [
        {"seed": openenv_seed("What is 2+3?", "5"), "prompt": "What is 2+3?", "label": "5"}
    ]
    first, second = env.step("I say a"), env.step("then b")
    assert [action.text for action in env.environment.actions] == ["I say a", "then b"]
    assert (first.observation, first.reward, first.done) == ("\n 1 \n", 0.25, False)
    assert (second.observation, second.reward, second.done) == ("\n 2 \n", 0.25, True)
    env.close()
    assert env.environment.closed


def test_an_action_of_several_fields_is_parsed_and_an_observation_of_several_shown_as_json(make_config):
    config = openenv_config(
        make_config,
        "Chess",
        "environment.openenv.action_parser=test_openenv:parse_move",
        'environment.openenv.observation_format="{observation}"',
    )
    env = OpenEnvEnvironment(config.environment)
    env.reset("", "")
    step = env.step(" knight e4")
    assert step.observation == '{"captured": 1, "position": "knight@e4"}' and step.reward == 1.0 and step.done
    # Or one field of it, named.
    config = openenv_config(
        make_config,
        "Chess",
        "environment.openenv.action_parser=test_openenv:parse_move",
        "environment.openenv.observation_field=position",
    )
    env = OpenEnvEnvironment(config.environment)
    env.reset("", "")
    assert env.step("rook a1").observation == "\nrook@a1\n"


def test_the_seed_is_the_rows_so_a_replica_that_takes_an_episode_up_deals_the_same_cards(make_config):
    config = openenv_config(
        make_config,
        "Dealer",
        "environment.openenv.action=test_openenv:Say",
        "environment.placement=bus",
        "generation.streaming=true",
    )

    def turn(k: int, prompt: str = "deal", label: str = "") -> EpisodeTurn:
        return EpisodeTurn(
            **new_header("b0", "generator-0", 0, {}),
            step=0,
            episode="0/0#0",
            turn=k,
            reply_to="generator-0/x",
            prompt_text=prompt,
            prompt_label=label,
            model_turns=[f"turn {i}" for i in range(k + 1)],
            observations=[""] * k,
        )

    first, other = EnvironmentService(config, "environment-0"), EnvironmentService(config, "environment-1")
    dealt = [first.process(turn(k))[0].observation for k in range(3)]
    # Replica 1 never saw the episode: it resets with the same seed and replays turns 0 and 1 before answering 2.
    (taken_up,) = other.process(turn(2))
    assert taken_up.status == "ok" and taken_up.observation == dealt[2]
    deck = list(range(52))
    random.Random(openenv_seed("deal", "")).shuffle(deck)
    assert dealt == [f"\ncard {card}\n" for card in reversed(deck[-3:])]
    # Another row, another deck (the n episodes of one prompt share theirs).
    assert EnvironmentService(config, "environment-2").process(turn(0, prompt="deal again"))[0].observation != dealt[0]


def test_an_environment_made_by_openenvs_own_scaffold_is_served_as_it_is(make_config, tmp_path, monkeypatch):
    """`openenv init` writes the environment an OpenEnv user starts from (an echo, reward 0.1 per character); the
    adapter serves it unchanged, finding its action type and field from its annotations."""
    openenv = Path(sys.executable).with_name("openenv")
    subprocess.run([str(openenv), "init", "echo_env"], cwd=tmp_path, check=True, capture_output=True, timeout=120)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = openenv_config(
        make_config,
        "echo_env.server.echo_env_environment:EchoEnvironment",
        "environment.openenv.observation_field=echoed_message",
    )
    env = OpenEnvEnvironment(config.environment)
    env.reset("Say it back", "")
    step = env.step("hello")
    assert type(env.environment).__name__ == "EchoEnvironment"
    assert (step.observation, step.reward, step.done) == ("\nhello\n", pytest.approx(0.5), False)
    assert env.environment.state.step_count == 1


# ------------------------------------------------------------------------------------------------ wrong configs


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["environment.openenv.environment=test_episodes:Counter"], "is not an OpenEnv environment"),
        (["environment.openenv.environment=test_openenv:Nothing"], "cannot be loaded"),
        (["environment.openenv.environment=test_openenv:Dealer"], "action type is not known"),
        (["environment.openenv.environment=test_openenv:Chess"], "which one the model's turn fills is not clear"),
        (
            ["environment.openenv.environment=test_openenv:Chess", "environment.openenv.action_field=knight"],
            "has no such field",
        ),
    ],
    ids=["not-openenv", "missing", "no-action-type", "ambiguous-action", "no-such-field"],
)
def test_an_environment_the_adapter_cannot_serve_is_refused_when_the_service_starts(make_config, overrides, says):
    config = make_config("environment.placement=local", *overrides)
    with pytest.raises(ValueError, match=says):
        load_environment(config.environment).stops(config.environment)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["environment.openenv.environment=test_openenv:Counting", "environment.tools=[python]"], "brings its own"),
        (
            ["environment.openenv.environment=test_openenv:Counting", "environment.name=test_episodes:Counter"],
            "is read by services.environment.adapters:OpenEnvEnvironment alone",
        ),
        (["environment.name=services.environment.adapters:OpenEnvEnvironment"], "needs environment.openenv"),
        (
            [
                "environment.openenv.environment=test_openenv:Chess",
                "environment.openenv.action_parser=test_openenv:parse_move",
                "environment.openenv.action_field=piece",
            ],
            "not both",
        ),
        (
            ["environment.openenv.environment=test_openenv:Counting", "environment.openenv.observation_format=x"],
            "must hold {observation}",
        ),
    ],
    ids=["tools", "other-name", "no-section", "parser-and-field", "format"],
)
def test_a_config_that_contradicts_itself_is_refused_at_load(make_config, overrides, says):
    with pytest.raises(ConfigError, match=says):
        make_config("environment.placement=local", *overrides)


# ------------------------------------------------------------------------------------------------------ an episode


def test_episodes_with_an_openenv_environment_are_its_observations_as_tokens(make_config):
    from test_episodes import observation_runs, sampled_episodes

    config = openenv_config(
        make_config,
        "Counting",
        "environment.openenv.stop=[a]",
        'environment.openenv.observation_format="{observation}"',
        "environment.max_turns=3",
    )
    (rollouts,), generator = sampled_episodes(config, streaming=False)
    observations = [generator.tokenizer(f" {n} ", add_special_tokens=False).input_ids for n in (1, 2)]
    answered = 0
    for i in range(rollouts.rows):
        length = int(rollouts.response_lengths[i])
        runs = observation_runs(rollouts.response_tokens[i, :length].tolist(), rollouts.response_mask[i, :length])
        assert runs == observations[: len(runs)]
        assert rollouts.environment_reward[i] == pytest.approx(0.5 * len(runs))
        assert bool(rollouts.finished[i]) == (len(runs) == 2), "done when the OpenEnv observation says so"
        answered += len(runs)
    assert answered, "no turn was answered: the test shows nothing"
