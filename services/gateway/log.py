"""The episodes log as one replica of the gateway reads and writes it (:class:`EpisodesLog`): every event applied to
its book of episodes (:mod:`.episodes`), its own at once when written, and read to its end where another replica may
have written what a request needs."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from common.schema import EpisodeEvent, new_header
from services.gateway.episodes import Episode, EpisodeBook
from services.gateway.http import Request
from services.service import Channel

log = logging.getLogger(__name__)

__all__ = ["CATCH_UP_S", "EpisodesLog", "episode_event"]

CATCH_UP_S = 5.0  # the longest the loop reads the episodes log to its end for one request


class EpisodesLog:
    """``lineage_of(episode)``: what its events carry (its prompt batch's lineage); ``version()``: the actor version
    its events are labelled with (the newest this replica has seen)."""

    def __init__(
        self,
        replica_id: str,
        tokenizer,
        counts: Counter[str],
        lineage_of: Callable[[Episode], dict],
        version: Callable[[], int],
    ):
        self.replica_id, self.counts, self.lineage_of, self.version = replica_id, counts, lineage_of, version
        self.book = EpisodeBook(tokenizer)
        self.peers: set[str] = set()  # other replicas that wrote to it
        self.channel: Channel | None = None

    def read(self) -> None:
        """Apply what the log holds that was not read yet."""
        for event in self.channel.receive():
            if event.producer != self.replica_id:
                self.peers.add(event.producer)
            self.book.apply(event, logged=True)
        for why in self.book.refused:
            self.counts["rewards_refused"] += 1
            log.warning("%s: a reward on the episodes log is left out: %s", self.replica_id, why)
        self.book.refused.clear()

    def catch_up(self) -> None:
        """Read the log to its end (what other replicas wrote before now), for at most CATCH_UP_S."""
        deadline = time.monotonic() + CATCH_UP_S
        while not self.channel.caught_up() and time.monotonic() < deadline:
            self.read()
        self.read()

    def read_on_for(self, request: Request) -> bool:
        """Read the log to its end for ``request``, once, where other replicas write to it (what it needs may be
        there, not read yet); whether it did."""
        if not self.peers or request.caught_up:
            return False
        self.catch_up()
        request.caught_up = True
        return True

    def write(self, event: EpisodeEvent) -> Episode:
        """Put ``event`` on the log (acknowledged by the broker: on the log before anyone is answered) and in the
        book; the episode it changed."""
        self.channel.send(event)
        return self.book.apply(event, logged=False) or self.book.get(event.episode)

    def event(self, episode: Episode, kind: str, event_id: str, version: int | None = None, lineage=None, **fields):
        """An event of ``episode`` from this replica (see :func:`episode_event`)."""
        lineage = {**self.lineage_of(episode), **(lineage or {})}
        version = self.version() if version is None else version
        return episode_event(episode, kind, event_id, self.replica_id, version, lineage, **fields)

    # The episode's lifecycle: taken, rewarded, ended (calls are written by .calls).

    def start(self, episode: Episode, agent: str, claim: str, prompt: str) -> Episode:
        """``episode`` taken by ``agent`` (``claim``: its claim's idempotency key, hashed; ``prompt`` recorded for a
        retried claim served elsewhere)."""
        self.write(self.event(episode, "start", f"{episode.id}/start", detail=agent, request_digest=claim,
                              prompt_text=prompt))  # fmt: skip
        self.counts["episodes_taken"] += 1
        return episode

    def reward(self, episode: Episode, event_id: str, total: float) -> None:
        """A reward of ``episode``, once whatever how often its ``event_id`` is written."""
        if event_id not in self.book.seen:
            self.write(self.event(episode, "reward", event_id, reward=total))

    def finish(self, episode: Episode, outcome: str, detail: str) -> None:
        """``episode``'s end (``rewarded`` with the sum of its rewards, else with none)."""
        reward = episode.reward if outcome == "rewarded" else 0.0
        self.write(self.event(episode, "end", f"{episode.id}/end", reward=reward, outcome=outcome, detail=detail))

    def claimed(self, claim: str) -> Episode | None:
        """The episode a claim of this idempotency key (hashed) took and that goes on, if any."""
        return next((e for e in self.book.episodes.values() if e.claim == claim and not e.over), None)


_EMPTY = {
    "parent": "",
    "request_digest": "",
    "messages": 0,
    "prompt_text": "",
    "prompt_tokens": np.zeros(0, np.int64),
    "response_tokens": np.zeros(0, np.int64),
    "behaviour_logprobs": np.zeros(0, np.float32),
    "token_versions": np.zeros(0, np.int32),
    "text": "",
    "finish_reason": "",
    "reward": 0.0,
    "outcome": "",
    "detail": "",
}


def episode_event(
    episode: Episode, kind: str, event_id: str, producer: str, version: int, lineage: dict, **fields
) -> EpisodeEvent:
    """An event of ``episode`` (its other fields empty): ``start``, ``call``, ``reward`` or ``end``."""
    return EpisodeEvent(
        **new_header(episode.batch_id, producer, version, {**lineage, "gateway.replica": producer}),
        step=episode.step,
        episode=episode.id,
        kind=kind,
        event=event_id,
        **(_EMPTY | fields),
    )
