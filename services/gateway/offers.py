"""The episodes one replica of the gateway offers to agents (:class:`Offers`): of the prompt batches it holds, the
groups the bound on staleness lets begin (as the generator starts groups, :class:`~common.admission.Admission`), ``n``
episodes each; the agents that wait for one; and what a claim answers (the episode's task)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from common.admission import Admission
from common.config import RunConfig
from common.schema import RUN_ID, PromptBatch
from services.gateway.episodes import Episode, EpisodeBook, episode_id, episode_key
from services.gateway.http import Request
from services.service import InputError

__all__ = ["HeldBatch", "IDLE_SAY_S", "Offers"]

IDLE_SAY_S = 30.0  # episodes offered and not taken for this long: say so


@dataclass
class HeldBatch:
    """A prompt batch held: its groups not yet sent (rows), and those not yet offered."""

    message: PromptBatch
    open_rows: set[int]
    unoffered: deque[int]


class Offers:
    def __init__(self, config: RunConfig, admission: Admission, book: EpisodeBook, run_id: str):
        self.config, self.admission, self.book, self.run_id = config, admission, book, run_id
        self.batches: dict[str, HeldBatch] = {}  # the prompt batches held, by batch id
        self.offered: deque[str] = deque()  # episodes of the batches held, to be taken
        self.claims: list[Request] = []  # agents waiting for an episode
        self.offered_since: float | None = None  # when the oldest offer not taken was made
        self.said_idle = 0.0

    def __len__(self) -> int:
        return len(self.offered)

    def __contains__(self, episode: str) -> bool:
        return episode in self.offered

    def room(self) -> int:
        """The next prompt batch is taken while fewer than a batch's episodes wait to be taken, and every group held
        that the bound allows has been offered. Groups the bound holds back never hold back the next batch: it may be
        an earlier one (after a restart the partitions are read in any order) whose groups the learner waits for. A
        batch the bound allows none of waits in the runner (``ready_for``), so what is taken stays within the bound."""
        few = len(self.offered) < self.config.data.batch_size * self.config.generation.n
        return int(few and not any(self._offerable(batch) for batch in self.batches.values()))

    def _offerable(self, batch: HeldBatch) -> bool:
        return bool(batch.unoffered) and self.admission.admits(batch.message.step, batch.unoffered[0])

    def admit(self, message: PromptBatch) -> None:
        if not 0 <= message.step < self.config.steps_possible:
            raise InputError(
                f"step {message.step} is outside the run's prompt batches 0..{self.config.steps_possible - 1}"
            )
        self.batches[message.batch_id] = HeldBatch(message, set(range(message.rows)), deque(range(message.rows)))

    def offer(self) -> None:
        """Offer the episodes of the groups the bound allows (one a predecessor handed out goes on, not offered)."""
        n = self.config.generation.n
        for batch in self.batches.values():
            while self._offerable(batch):
                row = batch.unoffered.popleft()
                for index in range(n):
                    episode = self.book.open(episode_id(batch.message.step, row, index), batch.message.batch_id)
                    if not episode.started and not episode.over:
                        self.offered.append(episode.id)
                        self.offered_since = self.offered_since or time.monotonic()

    def in_hand(self, version: int) -> str:
        """What the prompt batches held wait for: episodes offered and not taken, taken and not over, groups the
        bound holds back; '' when nothing is held."""
        if not self.batches:
            return ""
        unended = 0
        for batch in self.batches.values():
            for row in batch.open_rows:
                for index in range(self.config.generation.n):
                    episode = self.book.get(episode_id(batch.message.step, row, index))
                    if episode is not None and episode.started and not episode.over:
                        unended += 1
        said = [f"prompt batches {sorted(b.message.step for b in self.batches.values())} held"]
        if self.offered:
            waited = time.monotonic() - (self.offered_since or time.monotonic())
            said.append(f"{len(self.offered)} episodes offered, none taken for {waited:.0f} s (no agent claims)")
        if unended:
            said.append(f"{unended} episodes taken and not ended")
        bound = [b for b in self.batches.values() if b.unoffered]
        if bound:
            first = min(bound, key=lambda b: b.message.step)
            said.append(
                f"{sum(len(b.unoffered) for b in bound)} groups wait for the bound ("
                f"{self.admission.waiting_for(first.message.step, version)})"
            )
        return "; ".join(said)

    def take(self, episode: str | None = None) -> Episode:
        """The next episode offered (or ``episode``), no longer offered."""
        name = self.offered.popleft() if episode is None else episode
        if episode is not None and episode in self.offered:
            self.offered.remove(episode)
        if not self.offered:
            self.offered_since = None
        return self.book.get(name)

    def waited_too_long(self, now: float) -> list[Request]:
        """The claims that waited their ``wait_s`` for an episode, no longer waiting."""
        late = [r for r in self.claims if now - r.received >= r.body.wait_s]
        for request in late:
            self.claims.remove(request)
        return late

    def idle_for(self, now: float) -> float | None:
        """How long offers have waited for an agent, when that is worth saying now (every IDLE_SAY_S), else None."""
        if self.offered_since and now - self.offered_since > IDLE_SAY_S and now - self.said_idle > IDLE_SAY_S:
            self.said_idle = now
            return now - self.offered_since
        return None

    def idle_episodes(self, busy: set[str], limit_s: float) -> list[Episode]:
        """The episodes of held groups, taken and not over, with no call, reward or end for ``limit_s`` (those in
        ``busy`` excepted: a client waits for an answer)."""
        now, idle = time.monotonic(), []
        for batch in self.batches.values():
            for row in batch.open_rows:
                for index in range(self.config.generation.n):
                    episode = self.book.get(episode_id(batch.message.step, row, index))
                    if episode and episode.started and not episode.over and episode.id not in busy:
                        if now - episode.active >= limit_s:
                            idle.append(episode)
        return idle

    def lineage_of(self, episode: Episode) -> dict:
        """The lineage an episode's events carry: its prompt batch's, where this replica holds it."""
        batch = self.batches.get(episode.batch_id)
        return batch.message.lineage if batch is not None else {RUN_ID: self.run_id}

    def prompt_of(self, episode: Episode) -> tuple[str, str]:
        """The episode's prompt and label: its prompt batch's, or (a retried claim served by a replica that does not
        hold the batch) the prompt its start recorded."""
        batch = self.batches.get(episode.batch_id)
        if batch is None:
            return episode.prompt, ""
        return batch.message.prompt_text[episode.row], batch.message.prompt_label[episode.row]

    def task(self, episode: Episode, secret: bytes | None, url: str, model: str) -> dict:
        """What a claim answers: the episode, its key and base URL, the model, its prompt."""
        key = episode_key(episode.id, secret)
        prompt, label = self.prompt_of(episode)
        return {
            "episode": episode.id,
            "key": key,
            "base_url": f"{url}/episodes/{key}/v1",
            "api_key": key,
            "model": model,
            "prompt": prompt,
            "label": label,
            "step": episode.step,
            "row": episode.row,
            "index": episode.index,
            "gateway": url,
        }

    def forget_used_up(self) -> None:
        """Drop the episodes of groups the learner has used up (another replica's: this one holds its own until it
        sends them), keeping the book's memory bounded over a long run."""
        used = self.admission.groups_done - (self.admission.max_staleness + 1) * self.admission.per_update
        for episode in list(self.book.episodes.values()):
            if episode.batch_id not in self.batches and self.admission.groups_before(episode.step) + episode.row < used:
                self.book.forget(episode.id)
