"""Multi-turn episodes, token in and token out, on any sampler.

With an ``environment`` section each of a group's ``n`` responses is an episode: the model samples a turn (until
EOS, a stop string of the environment's, or ``generation.max_new_tokens``), the environment steps on the turn's text
(in a worker thread, bounded by ``environment.turn_timeout_s``), and its observation is tokenized alone and appended
to the episode's tokens, marked as not the model's; then the model samples its next turn from the prompt and every
token so far. The conversation is never re-tokenised: the tokens the model sampled are the tokens trained.

An episode ends when the environment says it is done (``finished``), or truncated: at ``environment.max_turns``, at
``environment.max_episode_tokens``, when a turn ends neither at EOS nor at a stop string (its token limit), or when
the environment does not answer in time (its reward then ``environment.timeout_reward``). A group goes on once all of
its episodes have ended, as :class:`common.sampling.Samples` with the model's mask, its turns and its environment
reward.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from common.config import RunConfig
from common.sampling import Sampler, Samples, SamplingParams
from services.environment.base import Environment, Step, load_environment

log = logging.getLogger(__name__)

__all__ = ["EpisodeSampler"]


@dataclass
class _Episode:
    group: str  # the group's key
    index: int  # which of its n responses
    prompt: list[int]
    params: SamplingParams
    environment: Environment
    tokens: list[int] = field(default_factory=list)
    models: list[bool] = field(default_factory=list)  # True at the tokens the model sampled
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    ended: bool = False
    finished: bool = False  # ended because the environment said done
    step: Future | None = None  # the environment's answer to the last turn, while it works on it
    deadline: float = 0.0


@dataclass
class _Group:
    episodes: list[_Episode]

    def ended(self) -> bool:
        return all(episode.ended for episode in self.episodes)


class EpisodeSampler:
    """Groups of episodes on ``sampler`` (each turn a request of one response); ``version()`` labels the tokens of a
    turn the sampler returns unlabelled (sampled whole by the weights loaded when it finished)."""

    def __init__(self, sampler: Sampler, tokenizer, config: RunConfig, version: Callable[[], int]):
        env = config.environment
        assert env is not None
        self.sampler, self.tokenizer, self.config, self.version = sampler, tokenizer, env, version
        self.environment_class = load_environment(env)
        self.max_new_tokens = config.generation.max_new_tokens
        self.max_tokens = config.max_response_tokens
        self.workers = ThreadPoolExecutor(env.workers, thread_name_prefix="environment")
        self.groups: dict[str, _Group] = {}
        self.turns: dict[str, _Episode] = {}  # the sampler's request key -> the episode whose turn it samples
        self.stepping: list[_Episode] = []  # waiting for their environment

    # ------------------------------------------------------------------ what the generator calls

    def submit(self, key: str, prompt: list[int], params: SamplingParams, text: str, label: str) -> None:
        """Start ``params.n`` episodes for one prompt (its tokens, text and label), a group named ``key``."""
        episodes = []
        for index in range(params.n):
            environment = self.environment_class(self.config)
            environment.reset(text, label)
            episodes.append(_Episode(key, index, list(prompt), params, environment))
        self.groups[key] = _Group(episodes)
        for episode in episodes:
            self._next_turn(episode)

    def step(self, seconds: float) -> list[tuple[str, Samples]]:
        """Let the sampler run for about ``seconds`` and the environments answer; the groups whose episodes all
        ended meanwhile."""
        self._take_answers()
        if self.sampler.in_flight():
            for request, samples in self.sampler.step(seconds):
                self._take_turn(self.turns.pop(request), samples)
        elif self.stepping:  # only environments at work: wait for the first answer, not longer than asked
            first = min(episode.deadline for episode in self.stepping)
            wait(
                [episode.step for episode in self.stepping],
                timeout=max(0.0, min(seconds, first - time.monotonic())),
                return_when=FIRST_COMPLETED,
            )
        self._take_answers()
        return [(key, self._samples(self.groups.pop(key))) for key in list(self.groups) if self.groups[key].ended()]

    def sample(
        self, prompt_tokens: torch.Tensor, prompt_lengths: torch.Tensor, params: SamplingParams, texts, labels
    ) -> Samples:
        """Every prompt's group of episodes, the prompts in order (a batch sampled whole)."""
        keys = [f"batch/{row}" for row in range(len(prompt_lengths))]
        rows = zip(keys, prompt_tokens, prompt_lengths.tolist(), texts, labels)
        for row, (key, tokens, length, text, label) in enumerate(rows):
            group = dataclasses.replace(params, seed=params.seed * 1_009 + row)  # each prompt's episodes its own
            self.submit(key, tokens[:length].tolist(), group, text, label)
        done: dict[str, Samples] = {}
        while len(done) < len(keys):
            done.update(self.step(0.05))
        return Samples.concat([done[key] for key in keys])

    def in_flight(self) -> int:
        return len(self.groups)

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the episode's steps

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
            stop=tuple(getattr(episode.environment, "stop", ())),
        )
        request = f"{episode.group}#{episode.index}.{episode.turns}"
        self.turns[request] = episode
        self.sampler.submit(request, episode.prompt + episode.tokens, params)

    def _take_turn(self, episode: _Episode, samples: Samples) -> None:
        """The model's turn is in: append it, then step the environment with its text (or end the episode)."""
        length = int(samples.response_lengths[0])
        tokens = samples.response_tokens[0, :length].tolist()
        versions = samples.token_versions[0, :length].tolist() if samples.token_versions is not None else None
        episode.tokens += tokens
        episode.models += [True] * length
        episode.logprobs += samples.behaviour_logprobs[0, :length].tolist()
        episode.versions += versions if versions is not None else [self.version()] * length
        episode.turns += 1
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        stopped = bool(samples.finished[0]) or text.rstrip().endswith(tuple(getattr(episode.environment, "stop", ())))
        if not stopped:  # the turn ran out of tokens: no complete call, no answer
            self._end(episode, finished=False)
            return
        episode.deadline = time.monotonic() + self.config.turn_timeout_s
        episode.step = self.workers.submit(episode.environment.step, text)
        self.stepping.append(episode)

    def _take_answers(self) -> None:
        """Append the observations that came in; end the episodes whose environment is done, failed, or too late."""
        now, waiting = time.monotonic(), []
        for episode in self.stepping:
            if not episode.step.done():
                if now < episode.deadline:
                    waiting.append(episode)
                    continue
                log.warning(
                    "episode %s#%d: the environment did not answer in %.0f s; the episode ends truncated",
                    episode.group,
                    episode.index,
                    self.config.turn_timeout_s,
                )
                episode.step.cancel()
                episode.reward += self.config.timeout_reward
                self._end(episode, finished=False, close=False)
                continue
            try:
                answer: Step = episode.step.result()
            except Exception as exc:  # an environment that fails ends its episode, never the generator
                log.warning("episode %s#%d: the environment failed: %r", episode.group, episode.index, exc)
                self._end(episode, finished=False)
                continue
            episode.reward += float(answer.reward)
            observation = (
                self.tokenizer(answer.observation, add_special_tokens=False).input_ids if answer.observation else []
            )
            episode.tokens += observation
            episode.models += [False] * len(observation)
            episode.logprobs += [0.0] * len(observation)
            episode.versions += [0] * len(observation)
            if answer.done:
                self._end(episode, finished=True)
            else:
                self._next_turn(episode)
        self.stepping = waiting

    def _end(self, episode: _Episode, finished: bool, close: bool = True) -> None:
        episode.ended, episode.finished, episode.step = True, finished, None
        if close:
            episode.environment.close()

    def _samples(self, group: _Group) -> Samples:
        """The group's episodes as one group of responses; an episode past its token budget is cut to it."""
        episodes = group.episodes
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
