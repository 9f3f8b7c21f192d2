"""Multi-turn episodes, token in and token out, on any sampler.

With an ``environment`` section each of a group's ``n`` responses is an episode: the model samples a turn (until
EOS, a stop string of the environment's, or ``generation.max_new_tokens``), the environment answers the turn's text,
and its observation is tokenized alone and appended to the episode's tokens, marked as not the model's; then the
model samples its next turn from the prompt and every token so far. The conversation is never re-tokenised: the
tokens the model sampled are the tokens trained.

Where the environments run is ``environment.placement``: ``bus``, environment replicas answer over the ``turns``
and ``observations`` topics (:class:`BusEnvironments`, through the runner's channel); ``local``, worker threads of
this process (:class:`LocalEnvironments`). Many episodes are in flight either way, the sampler working on some while
environments answer others.

An episode ends when the environment says it is done (``finished``), or truncated: at ``environment.max_turns``, at
the episode's token budget (``RunConfig.max_response_tokens``), when a turn ends neither at EOS nor at a stop string
(its token limit), when the environment fails, or when it does not answer within ``environment.turn_timeout_s`` of
the generator waiting (its reward then ``environment.timeout_reward``). A group goes on once all of its episodes have
ended, as :class:`common.sampling.Samples` with the model's mask, its turns and its environment reward.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from common.config import EnvironmentSection, RunConfig
from common.sampling import Sampler, Samples, SamplingParams
from common.schema import EnvironmentReply, EpisodeTurn, PromptBatch, episode_key, new_header
from services.environment.base import Environment, Step, load_environment
from services.service import Channel

log = logging.getLogger(__name__)

__all__ = ["BusEnvironments", "EpisodeSampler", "LocalEnvironments"]

TIMINGS_KEPT = 10_000  # turn timings kept for benchmarks (the latest)
AWAY_S = 1.0  # a gap between two steps longer than this is time the generator was not waiting for answers


@dataclass
class _Episode:
    id: str  # "<step>/<row>#<index>"
    group: str  # the group's key
    index: int  # which of its n responses
    prompt: list[int]
    params: SamplingParams
    origin: PromptBatch
    row: int
    tokens: list[int] = field(default_factory=list)
    models: list[bool] = field(default_factory=list)  # True at the tokens the model sampled
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    said: list[str] = field(default_factory=list)  # the model's turns, as text
    heard: list[str] = field(default_factory=list)  # the environment's answers, as text
    reward: float = 0.0
    ended: bool = False
    finished: bool = False  # ended because the environment said done
    asked: float = 0.0  # when its last turn went to the model, then to the environment (time.monotonic())
    deadline: float = 0.0  # while the environment works on its last turn

    @property
    def turns(self) -> int:
        return len(self.said)


class Environments(ABC):
    """Where episodes' environments run: they start episodes, take turns, and answer them (or fail, or time out)."""

    @abstractmethod
    def open(self, episode: _Episode) -> None:
        """An episode begins (its environment is reset with its prompt and label)."""

    @abstractmethod
    def ask(self, episode: _Episode) -> None:
        """The episode's last model turn (``episode.said[-1]``) is to be answered."""

    @abstractmethod
    def answers(self, waiting: dict[str, _Episode], wait_s: float) -> list[tuple[_Episode, Step | Exception]]:
        """Answers to episodes of ``waiting`` (by id) that came in, waiting up to ``wait_s`` for a first one."""

    def close_episode(self, episode: _Episode) -> None:
        """The episode ended (also while its environment still works on a turn)."""

    def close(self) -> None:
        pass


class LocalEnvironments(Environments):
    """Environments in worker threads of the generator's process (``environment.placement: local``)."""

    def __init__(self, config: EnvironmentSection):
        self.config, self.environment_class = config, load_environment(config)
        self.workers = ThreadPoolExecutor(config.workers, thread_name_prefix="environment")
        self.held: dict[str, Environment] = {}
        self.steps: dict[str, Future] = {}

    def open(self, episode: _Episode) -> None:
        environment = self.environment_class(self.config)
        environment.reset(episode.origin.prompt_text[episode.row], episode.origin.prompt_label[episode.row])
        self.held[episode.id] = environment

    def ask(self, episode: _Episode) -> None:
        self.steps[episode.id] = self.workers.submit(self.held[episode.id].step, episode.said[-1])

    def answers(self, waiting: dict[str, _Episode], wait_s: float) -> list[tuple[_Episode, Step | Exception]]:
        if wait_s > 0 and self.steps and not any(step.done() for step in self.steps.values()):
            wait(list(self.steps.values()), timeout=wait_s, return_when=FIRST_COMPLETED)
        done = []
        for id_, step in list(self.steps.items()):
            if step.done():
                del self.steps[id_]
                done.append((waiting[id_], step.exception() or step.result()))
        return done

    def close_episode(self, episode: _Episode) -> None:
        step = self.steps.pop(episode.id, None)
        environment = self.held.pop(episode.id, None)
        if step is not None:  # still at work (it timed out): it closes once done
            step.cancel()
            step.add_done_callback(lambda _: environment.close())
        elif environment is not None:
            environment.close()

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)


class BusEnvironments(Environments):
    """Environment replicas on the bus (``environment.placement: bus``): each turn goes out on the ``turns`` topic
    with the episode so far, and its answer comes back on ``observations``, addressed to this process alone."""

    def __init__(self, channel: Channel, replica_id: str, policy_version: Callable[[], int]):
        self.channel, self.policy_version = channel, policy_version
        # This process's address: a generator restarted under the same replica id never takes its predecessor's.
        self.reply_to = f"{replica_id}/{uuid.uuid4().hex[:12]}"
        self.replica_id = replica_id

    def open(self, episode: _Episode) -> None:
        pass  # the environment replica makes the episode's environment at its first turn

    def ask(self, episode: _Episode) -> None:
        origin = episode.origin
        self.channel.send(
            EpisodeTurn(
                **new_header(origin.batch_id, self.replica_id, self.policy_version(), origin.lineage),
                step=origin.step,
                episode=episode.id,
                turn=episode.turns - 1,
                reply_to=self.reply_to,
                prompt_text=origin.prompt_text[episode.row],
                prompt_label=origin.prompt_label[episode.row],
                model_turns=list(episode.said),
                observations=list(episode.heard),
            )
        )

    def answers(self, waiting: dict[str, _Episode], wait_s: float) -> list[tuple[_Episode, Step | Exception]]:
        done = []
        for reply in self.channel.receive():
            assert isinstance(reply, EnvironmentReply)
            episode = waiting.get(reply.episode)
            if reply.reply_to != self.reply_to or episode is None or reply.turn != episode.turns - 1:
                continue  # for another process, a turn not asked, or one answered already
            del waiting[reply.episode]  # a second answer to the turn (a re-delivery answered twice) is ignored
            if reply.status != "ok":
                done.append((episode, RuntimeError(f"the environment replica {reply.producer}: {reply.status}")))
            else:
                done.append((episode, Step(reply.observation, reply.reward, reply.done)))
        if not done and wait_s > 0:
            time.sleep(min(wait_s, 0.01))
        return done


class EpisodeSampler:
    """Groups of episodes on ``sampler`` (each turn a request of one response); ``version()`` is the policy
    version loaded, which labels the tokens of a turn the sampler returns unlabelled (sampled whole)."""

    def __init__(self, sampler: Sampler, tokenizer, config: RunConfig, version: Callable[[], int]):
        env = config.environment
        assert env is not None
        self.sampler, self.tokenizer, self.config, self.version = sampler, tokenizer, env, version
        self.stop = load_environment(env).stops(env)
        self.max_new_tokens = config.generation.max_new_tokens
        self.max_tokens = config.max_response_tokens
        self.environments: Environments | None = LocalEnvironments(env) if env.placement == "local" else None
        self.groups: dict[str, list[_Episode]] = {}
        self.turns: dict[str, _Episode] = {}  # the sampler's request key -> the episode whose turn it samples
        self.waiting: dict[str, _Episode] = {}  # by id: the episodes whose environment works on their last turn
        # Seconds from asking to having each model turn, and each environment answer: the latest (for benchmarks).
        self.last_step = time.monotonic()  # when step() last returned (see _pause_deadlines)
        self.model_seconds: deque[float] = deque(maxlen=TIMINGS_KEPT)
        self.environment_seconds: deque[float] = deque(maxlen=TIMINGS_KEPT)

    def connect(self, channel: Channel, replica_id: str) -> None:
        """Talk to the environment replicas over ``channel`` (placement bus)."""
        self.environments = BusEnvironments(channel, replica_id, self.version)

    # ------------------------------------------------------------------ what the generator calls

    def submit(self, key: str, prompt: list[int], params: SamplingParams, origin: PromptBatch, row: int) -> None:
        """Start ``params.n`` episodes for row ``row`` of ``origin`` (its ``prompt`` tokens), a group named ``key``."""
        if self.environments is None:
            raise RuntimeError("environment.placement is bus, but no channel to the environment replicas was given")
        episodes = [
            _Episode(episode_key(origin.step, row, index), key, index, list(prompt), params, origin, row)
            for index in range(params.n)
        ]
        self.groups[key] = episodes
        for episode in episodes:
            self.environments.open(episode)
            self._next_turn(episode)

    def step(self, seconds: float) -> list[tuple[str, Samples]]:
        """Let the sampler run for about ``seconds`` and the environments answer; the groups whose episodes all
        ended meanwhile."""
        self._pause_deadlines()
        self._take_answers(0.0)
        if self.sampler.in_flight():
            for request, samples in self.sampler.step(seconds):
                self._take_turn(self.turns.pop(request), samples)
        elif self.waiting:  # only environments at work: wait for an answer, not past a deadline
            first = min(episode.deadline for episode in self.waiting.values())
            self._take_answers(max(0.0, min(seconds, first - time.monotonic())))
        self._take_answers(0.0)
        self.last_step = time.monotonic()
        ended = [key for key, episodes in self.groups.items() if all(episode.ended for episode in episodes)]
        return [(key, self._samples(self.groups.pop(key))) for key in ended]

    def sample(self, message: PromptBatch, rows, params: SamplingParams) -> Samples:
        """The groups of episodes of ``rows`` of ``message``, in order (a batch sampled whole)."""
        keys = []
        for i, row in enumerate(rows):
            key = f"batch/{message.batch_id}/{row}"
            prompt = message.prompt_tokens[row, : int(message.prompt_lengths[row])].tolist()
            group = dataclasses.replace(params, seed=params.seed * 1_009 + i)  # each prompt's episodes their own
            self.submit(key, prompt, group, message, int(row))
            keys.append(key)
        done: dict[str, Samples] = {}
        while len(done) < len(keys):
            done.update(self.step(0.05))
        return Samples.concat([done[key] for key in keys])

    def in_flight(self) -> int:
        return len(self.groups)

    def close(self) -> None:
        if self.environments is not None:
            self.environments.close()

    # ------------------------------------------------------------------ the episode's steps

    def _pause_deadlines(self) -> None:
        """Move the environments' deadlines by the time this generator was away between two steps (longer than
        AWAY_S): a turn timeout counts the time the generator waits for an answer, not the time it spent elsewhere
        (loading weights; in the embedded run, the other services' turns, the environment's among them)."""
        now = time.monotonic()
        away = now - self.last_step
        if away > AWAY_S:
            for episode in self.waiting.values():
                episode.deadline += away

    def _next_turn(self, episode: _Episode) -> None:
        """Ask the model for the episode's next turn, within what is left of its budget."""
        budget = min(self.max_new_tokens, self.max_tokens - len(episode.tokens))
        if episode.turns >= self.config.max_turns or budget <= 0:
            self._end(episode, finished=False)
            return
        params = SamplingParams(
            n=1,
            max_new_tokens=budget,
            temperature=episode.params.temperature,
            top_p=episode.params.top_p,
            top_k=episode.params.top_k,
            seed=(episode.params.seed * 131 + episode.index) * 31 + episode.turns,
            stop=self.stop,
        )
        request = f"{episode.id}.{episode.turns}"
        self.turns[request] = episode
        episode.asked = time.monotonic()
        self.sampler.submit(request, episode.prompt + episode.tokens, params)

    def _take_turn(self, episode: _Episode, samples: Samples) -> None:
        """The model's turn is in: append it, then ask the environment to answer it (or end the episode)."""
        self.model_seconds.append(time.monotonic() - episode.asked)
        length = int(samples.response_lengths[0])
        tokens = samples.response_tokens[0, :length].tolist()
        versions = samples.token_versions[0, :length].tolist() if samples.token_versions is not None else None
        episode.tokens += tokens
        episode.models += [True] * length
        episode.logprobs += samples.behaviour_logprobs[0, :length].tolist()
        episode.versions += versions if versions is not None else [self.version()] * length
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        episode.said.append(text)
        # A turn ends at EOS, at the first stop string it holds (its last token may run past it), or at its token
        # budget: only the last leaves no complete call and no answer.
        if not samples.finished[0] and not any(stop in text for stop in self.stop):
            self._end(episode, finished=False)
            return
        episode.asked = time.monotonic()
        episode.deadline = episode.asked + self.config.turn_timeout_s
        self.waiting[episode.id] = episode
        self.environments.ask(episode)

    def _take_answers(self, wait_s: float) -> None:
        """Append the observations that came in; end the episodes whose environment is done, failed, or too late."""
        for episode, answer in self.environments.answers(self.waiting, wait_s):
            self.waiting.pop(episode.id, None)
            self.environment_seconds.append(time.monotonic() - episode.asked)
            if isinstance(answer, Exception):  # an environment that fails ends its episode, never the generator
                log.warning("episode %s: the environment failed: %s", episode.id, answer)
                self._end(episode, finished=False)
                continue
            episode.reward += float(answer.reward)
            episode.heard.append(answer.observation)
            observation = self.tokenizer(answer.observation, add_special_tokens=False).input_ids
            episode.tokens += observation
            episode.models += [False] * len(observation)
            episode.logprobs += [0.0] * len(observation)
            episode.versions += [0] * len(observation)
            if answer.done:
                self._end(episode, finished=True)
            else:
                self._next_turn(episode)
        now = time.monotonic()
        for episode in [episode for episode in self.waiting.values() if episode.deadline <= now]:
            log.warning(
                "episode %s: no answer from the environment in %.1f s; it ends truncated",
                episode.id,
                self.config.turn_timeout_s,
            )
            del self.waiting[episode.id]
            episode.reward += self.config.timeout_reward
            self._end(episode, finished=False)

    def _end(self, episode: _Episode, finished: bool) -> None:
        episode.ended, episode.finished = True, finished
        self.environments.close_episode(episode)

    def _samples(self, episodes: list[_Episode]) -> Samples:
        """The group's episodes as one group of responses; an episode past its token budget is cut to it."""
        for episode in episodes:
            for name in ("tokens", "models", "logprobs", "versions"):
                setattr(episode, name, getattr(episode, name)[: self.max_tokens])
        width = max(1, max(len(e.tokens) for e in episodes))

        def rows(name: str, dtype, pad) -> torch.Tensor:
            return torch.tensor([getattr(e, name) + [pad] * (width - len(e.tokens)) for e in episodes], dtype=dtype)

        return Samples(
            group_index=torch.zeros(len(episodes), dtype=torch.long),
            response_tokens=rows("tokens", torch.long, self.tokenizer.pad_token_id),
            response_lengths=torch.tensor([len(e.tokens) for e in episodes], dtype=torch.long),
            finished=torch.tensor([e.finished for e in episodes]),
            behaviour_logprobs=rows("logprobs", torch.float32, 0.0),
            token_versions=rows("versions", torch.int32, 0),
            model_mask=rows("models", torch.bool, False),
            turns=torch.tensor([max(1, e.turns) for e in episodes], dtype=torch.long),
            environment_reward=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
        )
