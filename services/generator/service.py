"""generator: prompts → rollouts. Samples n responses per prompt with the actor and records behaviour log-probs.

A prompt batch is taken once the learner's progress allows its first group (bounded staleness counted in groups,
see :meth:`GeneratorService.ready_for`). In batch mode it is sampled whole, as one record. With
``generation.streaming`` the generator streams: prompt batches are admitted while fewer than a batch's groups wait,
each group is sampled only when the bound allows it, by the weights loaded at that moment, and sent on at once
(``generation.groups_per_record`` of one prompt batch to a record).
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch

from common.config import RunConfig
from common.models import load_tokenizer, resolve_model
from common.sampling import SamplingParams
from common.schema import ADAPTER_BASE, LEARNER_GROUPS_DONE, PromptBatch, RolloutBatch, WeightAnnouncement, new_header
from common.weights import WeightIntegrityError
from services.generator.samplers import make_sampler
from services.service import Collected, InputError, Service, check_token_ids, load_announced_weights

log = logging.getLogger(__name__)


class GeneratorService(Service):
    role = "generator"

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        super().__init__(config, replica_id)
        path = resolve_model(config.model.actor, config.model.cache_dir)
        self.tokenizer = load_tokenizer(path, config.model.trust_remote_code)
        self.sampler = make_sampler(config, path, self.tokenizer)
        log.info("%s: sampling with the %s backend", self.replica_id, self.sampler.backend)
        self.model_id = str(path)
        self.policy_version = 0  # the configured initial weights are version 0
        self.digest = ""  # of the snapshot loaded ("": the configured initial weights)
        self.groups_done = 0  # groups the learner had used up when it announced the weights loaded
        self.queue: deque[tuple[PromptBatch, int]] = deque()  # streaming: the groups admitted, not yet sampled
        broadcast = config.weights.broadcast
        if broadcast.address is not None:
            self.sampler.join_broadcast(broadcast.address, broadcast.timeout_s, config.weights.digest, self.replica_id)

    def on_weights(self, announcement: WeightAnnouncement) -> bool:
        mismatch = self._kind_mismatch(announcement)
        if mismatch:
            log.error("%s: keeping actor v%d: %s", self.replica_id, self.policy_version, mismatch)
            return False
        groups_done = int(announcement.lineage.get(LEARNER_GROUPS_DONE, announcement.policy_version * self._per_update))
        if self._holds(announcement):  # the learner's progress alone (groups used up without an update)
            self.groups_done = max(self.groups_done, groups_done)
            return True
        if not self._load_broadcast(announcement) and not load_announced_weights(
            self.sampler.load_snapshot, announcement, self.replica_id, self.policy_version
        ):
            return False
        self.policy_version, self.digest = announcement.policy_version, announcement.digest
        self.groups_done = groups_done
        return True

    def _holds(self, announcement: WeightAnnouncement) -> bool:
        """Whether the weights announced are the ones loaded (the initial weights are version 0's)."""
        same_version = announcement.policy_version == self.policy_version
        return same_version and (announcement.digest == self.digest or (self.policy_version == 0 and not self.digest))

    @property
    def _per_update(self) -> int:
        return self.config.groups_per_update

    def _kind_mismatch(self, announcement: WeightAnnouncement) -> str:
        """Why the announced snapshot is not for this generator (LoRA adapters for its base, or a whole model, as it
        serves); empty when it is."""
        adapts, lora = announcement.lineage.get(ADAPTER_BASE), self.config.model.lora is not None
        if (adapts is not None) == lora and adapts in (None, self.config.model.actor):
            return ""
        made = f"LoRA adapters for {adapts}" if adapts is not None else "a whole model"
        served = f"LoRA adapters on {self.config.model.actor}" if lora else "a whole model"
        return f"the snapshot of v{announcement.policy_version} is {made}, this generator serves {served}"

    def _load_broadcast(self, announcement: WeightAnnouncement) -> bool:
        """Load the announced version from what the learner broadcast, if this replica holds exactly that."""
        if self.config.weights.broadcast.address is None or not announcement.broadcast_digest:
            return False
        version = announcement.policy_version
        try:
            loaded = self.sampler.load_broadcast(version, announcement.broadcast_digest, announcement.chain)
        except WeightIntegrityError as exc:
            log.error(
                "%s: the broadcast of actor v%d does not fit (%s); reading the store", self.replica_id, version, exc
            )
            return False
        if loaded:
            log.info("%s: actor weights v%d loaded from the broadcast", self.replica_id, version)
        return loaded

    def ready_for(self, message: PromptBatch) -> bool:
        # Bounded staleness, counted in groups: a group is sampled at most (max_staleness + 1) updates' worth of
        # groups ahead of what the learner has used up (trained or dropped), so it is trained within max_staleness
        # versions of the policy that sampled it, however many groups each update takes or drops. A prompt batch is
        # taken once its first group may be sampled: waiting for all of its groups could wait for good (the learner
        # holding part of an update, dropped groups, needing this batch to finish it). Streaming then samples each
        # group only when it may; a whole batch at once may overrun the bound by its other groups, which the
        # learner drops (with dynamic sampling; otherwise the config keeps updates to whole batches). A step
        # outside the run is let through for process() to dead-letter: held, it would wait for good.
        in_run = 0 <= message.step < self.config.prompt_batches
        return not in_run or self.admits(message.step, 0)

    def admits(self, step: int, row: int) -> bool:
        """Whether the group of ``row`` of prompt batch ``step`` may be sampled now."""
        return self._groups_before(step) + row < self._admissible()

    def _groups_before(self, step: int) -> int:
        """Groups fed before prompt batch ``step``."""
        return step * self.config.data.batch_size

    def _admissible(self) -> int:
        """Groups that may have been fed: those used up, and (max_staleness + 1) updates' worth more."""
        return self.groups_done + (self.config.pipeline.max_staleness + 1) * self._per_update

    def waiting_for(self, message: PromptBatch) -> str:
        enough = self._groups_before(message.step) - self._admissible() + self.groups_done
        return (
            f"prompt batch {message.step} waits for the learner to have used up more than {enough} groups (it has "
            f"used up {self.groups_done}, actor v{self.policy_version})"
        )

    def process(self, message: PromptBatch) -> list[RolloutBatch]:
        self._check(message)
        return [self._rollouts(message, np.arange(message.rows), self.config.run.seed * 1_000_003 + message.step)]

    # ------------------------------------------------------------------ streaming (generation.streaming)

    @property
    def streams(self) -> bool:
        return self.config.generation.streaming

    def room(self) -> int:
        # The next prompt batch is admitted while fewer than a batch's groups wait: sampling never runs dry.
        return int(len(self.queue) < self.config.data.batch_size)

    def admit(self, message: PromptBatch) -> None:
        self._check(message)
        self.queue.extend((message, row) for row in range(message.rows))

    def collect(self) -> list[Collected]:
        """Sample the next groups (up to ``generation.groups_per_record``, of one prompt batch) by the weights loaded
        now, as one record; the prompt batch is done with its last group."""
        message = self.queue[0][0] if self.queue else None
        rows = []
        while (
            self.queue
            and self.queue[0][0] is message
            and len(rows) < self.config.generation.groups_per_record
            and self.admits(message.step, self.queue[0][1])
        ):
            rows.append(self.queue.popleft()[1])
        if not rows:
            return []
        seed = (self.config.run.seed * 1_000_003 + message.step) * 1_009 + rows[0]
        rollouts = self._rollouts(message, np.array(rows), seed)
        rollouts.batch_id = f"{message.batch_id}/{rows[0]}-{rows[-1]}"
        done = not (self.queue and self.queue[0][0] is message)
        return [Collected(message.batch_id, [rollouts], done)]

    # ------------------------------------------------------------------ internals

    def _check(self, message: PromptBatch) -> None:
        if not 0 <= message.step < self.config.prompt_batches:
            raise InputError(
                f"step {message.step} is outside the run's prompt batches 0..{self.config.prompt_batches - 1}"
            )
        check_token_ids(message, self.sampler.skeleton, "actor")

    def _rollouts(self, message: PromptBatch, prompts: np.ndarray, seed: int) -> RolloutBatch:
        """The groups of ``prompts`` (rows of the prompt batch), sampled by the weights loaded now."""
        gen = self.config.generation
        params = SamplingParams(
            n=gen.n,
            max_new_tokens=gen.max_new_tokens,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            seed=seed,
        )
        samples = self.sampler.sample(
            torch.from_numpy(message.prompt_tokens[prompts]), torch.from_numpy(message.prompt_lengths[prompts]), params
        )
        lineage = {
            **message.lineage,
            **params.lineage(),
            "generator.backend": self.sampler.backend,
            "actor.model": self.model_id,
        }
        return self._rollout_batch(message, prompts, samples, message.batch_id, self.policy_version, lineage)

    def _rollout_batch(
        self, message: PromptBatch, prompts: np.ndarray, samples, batch_id: str, version: int, lineage: dict
    ) -> RolloutBatch:
        """The record of ``samples`` of the groups of ``prompts`` (rows of the prompt batch)."""
        rows = prompts[samples.group_index.numpy()]
        real = np.arange(samples.response_tokens.shape[1]) < samples.response_lengths.numpy()[:, None]
        versions = samples.token_versions.numpy() if samples.token_versions is not None else np.where(real, version, 0)
        oldest = int(versions[real].min()) if real.any() else version  # the header's: the oldest token's
        return RolloutBatch(
            **new_header(batch_id, self.replica_id, oldest, lineage),
            step=message.step,
            group_index=rows,
            prompt_text=[message.prompt_text[i] for i in rows],
            prompt_label=[message.prompt_label[i] for i in rows],
            response_text=self.tokenizer.batch_decode(samples.response_tokens, skip_special_tokens=True),
            prompt_tokens=message.prompt_tokens[rows],
            prompt_lengths=message.prompt_lengths[rows],
            response_tokens=samples.response_tokens.numpy(),
            response_lengths=samples.response_lengths.numpy(),
            finished=samples.finished.numpy(),
            behaviour_logprobs=samples.behaviour_logprobs.numpy(),
            token_versions=versions.astype(np.int32),
        )

    def close(self) -> None:
        self.sampler.close()
