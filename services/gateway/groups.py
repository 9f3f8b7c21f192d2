"""A group's record once every episode of it has ended (as the log has it): each episode's rows (:mod:`.episodes`)
with its reward, or, for an episode that ended without one, as ``gateway.unrewarded`` says (trained with a given
reward or the run's scorer's, or dead-lettered); a group with nothing left to train on goes on empty, dead-lettered
whole, so that the learner counts it as used up."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import numpy as np

from common.config import RunConfig
from common.rollouts import SampledRows, rollout_batch
from common.schema import PromptBatch, RolloutBatch
from services.gateway.episodes import Episode, EpisodeBook, Row, episode_id
from services.gateway.offers import HeldBatch
from services.service import Collected

log = logging.getLogger(__name__)

__all__ = ["GroupRecords"]


class GroupRecords:
    """Turns ended groups into rollouts records, counting each episode's outcome in ``counts``."""

    def __init__(self, config: RunConfig, tokenizer, producer: str, model_id: str, counts: Counter[str]):
        self.config, self.tokenizer, self.producer, self.model_id = config, tokenizer, producer, model_id
        self.counts = counts

    def settle(
        self, batches: dict[str, HeldBatch], book: EpisodeBook, version: int, dead_letter: Callable
    ) -> list[Collected]:
        """The records of the held groups whose episodes have all ended (as the log has it), their episodes then
        forgotten, and a prompt batch all of whose groups went no longer held."""
        out, n = [], self.config.generation.n
        for batch_id, batch in list(batches.items()):
            for row in sorted(batch.open_rows):
                episodes = [book.get(episode_id(batch.message.step, row, i)) for i in range(n)]
                if not all(episode is not None and episode.end is not None for episode in episodes):
                    continue
                batch.open_rows.remove(row)
                record = self.record(batch.message, row, episodes, version, dead_letter)
                out.append(Collected(batch_id, [record], not batch.open_rows))
                for episode in episodes:
                    book.forget(episode.id)
            if not batch.open_rows:
                del batches[batch_id]
        return out

    def record(
        self, message: PromptBatch, row: int, episodes: list[Episode], version: int, dead_letter: Callable
    ) -> RolloutBatch:
        """The group's record; ``dead_letter(record, why)`` sets aside an episode left unrewarded (the policy's)."""
        gateway = self.config.gateway
        kept: list[tuple[Row, float]] = []
        for episode in episodes:
            outcome, rows = episode.end.outcome, episode.rows()
            self.counts[f"episodes_{outcome}"] += 1
            self.counts["rows_split"] += max(0, len(rows) - 1)
            if not rows:
                self.counts["episodes_without_calls"] += 1
                continue
            if outcome == "rewarded":
                reward = episode.reward
            elif gateway.unrewarded == "dead_letter":
                detail = episode.end.detail or "no detail"
                why = f"episode {episode.id} {outcome.replace('_', ' ')} without a reward ({detail})"
                dead_letter(self._record(message, row, [(r, 0.0) for r in rows], version), why)
                self.counts["episodes_dead_lettered"] += 1
                continue
            else:
                reward = gateway.unrewarded_reward if gateway.unrewarded == "reward" else 0.0
            kept += [(r, reward) for r in rows]
        if not kept:  # the record still goes, empty, so that the learner counts the group as used up
            log.warning("%s: group %d/%d has no episode to train on: it is dead-lettered whole", self.producer,
                        message.step, row)  # fmt: skip
            self.counts["groups_dead_lettered"] += 1
        return self._record(message, row, kept, version, dead=not kept)

    def _record(
        self, message: PromptBatch, row: int, rows: list[tuple[Row, float]], version: int, dead: bool = False
    ) -> RolloutBatch:
        """The record of a group's ``rows`` (each with its reward), or of none: a group ``dead``-lettered whole."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        prompt_width = max((len(r.prompt_tokens) for r, _ in rows), default=1)
        width = max((len(r.response_tokens) for r, _ in rows), default=1)

        def padded(arrays, size, value, dtype):
            out = np.full((len(arrays), size), value, dtype=dtype)
            for i, array in enumerate(arrays):
                out[i, : len(array)] = array
            return out

        responses = padded([r.response_tokens for r, _ in rows], width, pad, np.int64)
        lengths = np.array([len(r.response_tokens) for r, _ in rows], np.int64)
        sampled = SampledRows(
            group_index=np.full(len(rows), row, np.int64),
            prompt_tokens=padded([r.prompt_tokens for r, _ in rows], prompt_width, pad, np.int64),
            prompt_lengths=np.array([len(r.prompt_tokens) for r, _ in rows], np.int64),
            response_tokens=responses,
            response_lengths=lengths,
            response_text=[self.tokenizer.decode(t[:n], skip_special_tokens=True) for t, n in zip(responses, lengths)],
            finished=np.array([r.finish_reason == "stop" for r, _ in rows], bool),
            behaviour_logprobs=padded([r.logprobs for r, _ in rows], width, 0.0, np.float32),
            token_versions=padded([r.versions for r, _ in rows], width, 0, np.int32),
            response_mask=padded([r.model_mask for r, _ in rows], width, False, bool),
            turns=np.array([r.calls for r, _ in rows], np.int64),
            environment_reward=np.array([reward for _, reward in rows], np.float32),
        )
        gen = self.config.generation
        lineage = {
            **message.lineage,
            "sampling.temperature": gen.temperature,
            "sampling.top_p": gen.top_p,
            "sampling.top_k": gen.top_k,
            "gateway.replica": self.producer,
            "actor.model": self.model_id,
        }
        batch_id = f"{message.batch_id}/{row}-{row}"
        return rollout_batch(message, sampled, batch_id, self.producer, lineage, version, (row,) if dead else ())
