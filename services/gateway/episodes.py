"""Agents' episodes as the episodes log tells them: each replica of the gateway keeps a book of every episode from
the events it reads (and those it writes, at once), and the replica that holds an episode's prompt batch turns its
calls into rows once it has ended.

**Rows.** Each call extends the earlier call it names as its parent, or none (:mod:`.conversation`). An episode whose
calls form one chain is one row: the first call's prompt, then everything after it, the model's sampled tokens
marked as its own (trained) and the rest (the agent's messages, tool results, the chat template's markup) as
context. A call that extends no earlier one (the client edited or dropped a message) and a call that extends one
already extended (a branch) make the episode's calls a tree: each leaf's chain from its root is a row, every row of
the episode with the episode's reward. Splits are counted (``rows`` > 1).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from dataclasses import dataclass, field

import numpy as np

from common.schema import EpisodeEvent
from services.gateway.api import MAX_REWARD
from services.gateway.conversation import CallView

__all__ = [
    "Call",
    "Episode",
    "EpisodeBook",
    "EpisodeKeyError",
    "Row",
    "episode_id",
    "episode_key",
    "episode_of_key",
    "parse_episode_id",
]


def episode_id(step: int, row: int, index: int) -> str:
    """As :func:`common.schema.episode_key`: ``<step>/<row>#<index>``."""
    return f"{step}/{row}#{index}"


def parse_episode_id(episode: str) -> tuple[int, int, int] | None:
    """``(step, row, index)`` of an episode id, or None for one that is not."""
    group, sep, index = episode.partition("#")
    step, slash, row = group.partition("/")
    if not (sep and slash and step.isdigit() and row.isdigit() and index.isdigit()):
        return None
    return int(step), int(row), int(index)


_KEY = re.compile(r"^e(\d{1,12})-(\d{1,9})-(\d{1,6})(?:\.([0-9a-f]{16}))?$")


class EpisodeKeyError(ValueError):
    """An episode key that is not one (malformed, or its MAC does not hold)."""


def episode_key(episode: str, secret: bytes | None) -> str:
    """The key of an episode, URL-safe, in its base URL and as its API key: ``e<step>-<row>-<index>``, and with the
    run's signing key a MAC of it (``.<16 hex>``): without the key nobody can make one for an episode."""
    step, row, index = parse_episode_id(episode)
    key = f"e{step}-{row}-{index}"
    return f"{key}.{_mac(secret, episode)}" if secret else key


def episode_of_key(key: str, secret: bytes | None) -> str:
    """The episode a key names; :class:`EpisodeKeyError` for one that is not a key (or, with a signing key, forged)."""
    found = _KEY.match(key or "")
    if found is None:
        # The key is not echoed back: it may be a secret the client sent here by mistake (another service's API key).
        raise EpisodeKeyError(
            "the API key is not an episode key (e<step>-<row>-<index>, as an episode's claim gives it)"
        )
    episode = episode_id(int(found[1]), int(found[2]), int(found[3]))
    if secret and not (found[4] and hmac.compare_digest(found[4], _mac(secret, episode))):
        raise EpisodeKeyError(f"the key of episode {episode} is not one this run made")
    return episode


def _mac(secret: bytes, episode: str) -> str:
    return hmac.new(secret, f"episode {episode}".encode(), hashlib.sha256).hexdigest()[:16]


@dataclass
class Call:
    """One call of an episode, as its event holds it, and what follows from its parent."""

    event: EpisodeEvent
    view: CallView  # the whole prompt (its parent's, then its own), for the calls that may extend it

    @property
    def id(self) -> str:
        return self.event.event

    @property
    def parent(self) -> str:
        return self.event.parent


@dataclass
class Episode:
    id: str
    step: int
    row: int
    index: int
    batch_id: str  # its prompt batch's
    agent: str = ""  # who took it ('' until it is taken)
    claim: str = ""  # the claim that took it, by its idempotency key's hash ('' for a claim without one)
    prompt: str = ""  # its prompt, as its start recorded it
    calls: dict[str, Call] = field(default_factory=dict)  # by id, in the order they came
    rewards: list[float] = field(default_factory=list)  # as posted
    ending: EpisodeEvent | None = None  # written here, not read back from the log yet: no more calls
    end: EpisodeEvent | None = None  # as the log has it (the first end there): what becomes of the episode
    late: int = 0  # calls and rewards after its end (not trained)
    active: float = field(default_factory=time.monotonic)  # when something last happened to it

    @property
    def started(self) -> bool:
        return bool(self.agent)

    @property
    def over(self) -> bool:
        return self.ending is not None or self.end is not None

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))

    def views(self) -> list[CallView]:
        return [call.view for call in self.calls.values()]

    def rows(self) -> list[Row]:
        """Its calls as rows: one per leaf of the tree the parent links make (see the module's docstring)."""
        children = {call.parent for call in self.calls.values() if call.parent}
        rows = []
        for leaf in (call for call in self.calls.values() if call.id not in children):
            chain = [leaf]
            while chain[0].parent and chain[0].parent in self.calls:
                chain.insert(0, self.calls[chain[0].parent])
            rows.append(Row.of(chain))
        return rows


@dataclass(frozen=True)
class Row:
    """One row of an episode: its first prompt, and the response after it with the model's tokens marked."""

    prompt_tokens: np.ndarray  # (P,) int64
    response_tokens: np.ndarray  # (T,) int64
    model_mask: np.ndarray  # (T,) bool
    logprobs: np.ndarray  # (T,) float32, 0 where not the model's
    versions: np.ndarray  # (T,) int32, 0 where not the model's
    calls: int  # the model's turns
    finish_reason: str  # the last call's

    @classmethod
    def of(cls, chain: list[Call]) -> Row:
        parts: list[tuple[np.ndarray, bool, np.ndarray | None, np.ndarray | None]] = []
        for position, call in enumerate(chain):
            event = call.event
            if position:  # what came between the answer before and this call's (context)
                parts.append((event.prompt_tokens, False, None, None))
            parts.append((event.response_tokens, True, event.behaviour_logprobs, event.token_versions))

        def joined(pick, dtype) -> np.ndarray:
            return np.concatenate([pick(*part).astype(dtype) for part in parts]) if parts else np.zeros(0, dtype)

        return cls(
            prompt_tokens=np.asarray(chain[0].event.prompt_tokens, np.int64),
            response_tokens=joined(lambda tokens, model, lp, v: tokens, np.int64),
            model_mask=joined(lambda tokens, model, lp, v: np.full(len(tokens), model), bool),
            logprobs=joined(lambda tokens, model, lp, v: lp if model else np.zeros(len(tokens)), np.float32),
            versions=joined(lambda tokens, model, lp, v: v if model else np.zeros(len(tokens)), np.int32),
            calls=len(chain),
            finish_reason=chain[-1].event.finish_reason,
        )


class EpisodeBook:
    """Every episode this replica knows of, from the events of the episodes log. Applying an event twice (one this
    replica wrote, then read back) changes nothing; the first end the log has decides an episode's outcome."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.specials = set(tokenizer.all_special_ids)
        self.episodes: dict[str, Episode] = {}
        self.seen: set[str] = set()  # the ids of the events applied
        self.gone: set[str] = set()  # episodes forgotten (ended, their group sent or used up)
        self.refused: list[str] = []  # reward events of the log that no API would have taken (why, each)

    def get(self, episode: str) -> Episode | None:
        return self.episodes.get(episode)

    def open(self, episode: str, batch_id: str) -> Episode:
        """The episode, known from now on (a replica that holds its prompt batch offers it)."""
        if episode not in self.episodes:
            step, row, index = parse_episode_id(episode)
            self.episodes[episode] = Episode(episode, step, row, index, batch_id)
        return self.episodes[episode]

    def apply(self, event: EpisodeEvent, logged: bool) -> Episode | None:
        """Apply ``event``; ``logged``: read from the log (else just written here). Returns the episode it changed, or
        None (seen already, or an event of an episode id that cannot be)."""
        if parse_episode_id(event.episode) is None or event.episode in self.gone:
            return None
        episode = self.open(event.episode, event.batch_id)
        ended = event.kind == "end" and logged and episode.end is None
        if ended:
            episode.end = event  # the log's first end; one written here, if another, came second
        if event.event in self.seen:
            return episode if ended else None
        self.seen.add(event.event)
        episode.active = time.monotonic()
        if event.kind == "start":
            episode.agent = event.detail or "agent"
            episode.claim, episode.prompt = event.request_digest, event.prompt_text
        elif event.kind == "end":
            episode.ending = episode.ending or event
        elif episode.end is not None or (event.kind == "call" and event.parent and event.parent not in episode.calls):
            episode.late += 1  # after its end on the log (or naming a call it has not had): not trained
        elif event.kind == "reward":
            # The API refuses such a reward (400); one on the log anyway (written before it did, or by another
            # client of the topic) is left out, never trained: a sum past float32 could not be encoded, and every
            # replica reading the log again would fail on it again.
            if not abs(event.reward) <= MAX_REWARD or not abs(episode.reward + event.reward) <= MAX_REWARD:
                self.refused.append(f"episode {episode.id}: reward {event.reward:g} is outside ±{MAX_REWARD:g}")
            else:
                episode.rewards.append(event.reward)
        elif event.kind == "call":
            episode.calls[event.event] = Call(event, self._view(episode, event))
        return episode

    def _view(self, episode: Episode, event: EpisodeEvent) -> CallView:
        tokens = tuple(int(t) for t in event.prompt_tokens)
        response = tuple(int(t) for t in event.response_tokens)
        text, row_start = event.prompt_text, len(tokens)
        if event.parent:
            before = episode.calls[event.parent].view
            text = before.context + text
            tokens = before.prompt_tokens + before.response_tokens + tokens
            row_start = before.row_start
        end = self.tokenizer.decode([response[-1]]) if response and response[-1] in self.specials else ""
        written = self.tokenizer.decode(list(response), skip_special_tokens=True)
        return CallView(event.event, text, tokens, response, event.text, written, end, row_start, event.messages)

    def forget(self, episode: str) -> None:
        """Drop what the book holds of an ended episode (its events stay marked as seen)."""
        if self.episodes.pop(episode, None) is not None:
            self.gone.add(episode)
