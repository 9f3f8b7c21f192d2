"""generator: prompts → rollouts. Samples n responses per prompt with the actor and records behaviour log-probs."""

from __future__ import annotations

import logging

import torch

from common.config import RunConfig
from common.models import load_tokenizer, resolve_model
from common.sampling import SamplingParams
from common.schema import ADAPTER_BASE, PromptBatch, RolloutBatch, WeightAnnouncement, new_header
from common.weights import WeightIntegrityError
from services.generator.samplers import make_sampler
from services.service import InputError, Service, check_token_ids, load_announced_weights

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
        broadcast = config.weights.broadcast
        if broadcast.address is not None:
            self.sampler.join_broadcast(broadcast.address, broadcast.timeout_s, config.weights.digest, self.replica_id)

    def on_weights(self, announcement: WeightAnnouncement) -> bool:
        mismatch = self._kind_mismatch(announcement)
        if mismatch:
            log.error("%s: keeping actor v%d: %s", self.replica_id, self.policy_version, mismatch)
            return False
        if not self._load_broadcast(announcement) and not load_announced_weights(
            self.sampler.load_snapshot, announcement, self.replica_id, self.policy_version
        ):
            return False
        self.policy_version = announcement.policy_version
        return True

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
        # Bounded staleness: batch `step` may be sampled by a policy at most max_staleness versions behind it. A step
        # outside the run is let through for process() to dead-letter: held, it would block its partition for good.
        in_run = 0 <= message.step < self.config.run.steps
        return not in_run or message.step - self.policy_version <= self.config.pipeline.max_staleness

    def waiting_for(self, message: PromptBatch) -> str:
        needed = message.step - self.config.pipeline.max_staleness
        return f"prompt batch {message.step} waits for actor v{needed} (has v{self.policy_version})"

    def process(self, message: PromptBatch) -> list[RolloutBatch]:
        if not 0 <= message.step < self.config.run.steps:
            raise InputError(f"step {message.step} is outside the run's steps 0..{self.config.run.steps - 1}")
        check_token_ids(message, self.sampler.skeleton, "actor")
        gen = self.config.generation
        params = SamplingParams(
            n=gen.n,
            max_new_tokens=gen.max_new_tokens,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            seed=self.config.run.seed * 1_000_003 + message.step,
        )
        samples = self.sampler.sample(
            torch.from_numpy(message.prompt_tokens), torch.from_numpy(message.prompt_lengths), params
        )
        rows = samples.group_index.numpy()
        lineage = {
            **message.lineage,
            **params.lineage(),
            "generator.backend": self.sampler.backend,
            "actor.model": self.model_id,
        }
        return [
            RolloutBatch(
                **new_header(message.batch_id, self.replica_id, self.policy_version, lineage),
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
            )
        ]

    def close(self) -> None:
        self.sampler.close()
