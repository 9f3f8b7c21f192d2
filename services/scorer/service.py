"""scorer: rollouts → scored. The reward model's score and the frozen reference model's log-probs.

Both models are frozen, so scorer replicas are interchangeable and scale on their own.
"""

from __future__ import annotations

import torch

from common.config import RunConfig
from common.models import FrozenModels, load_actor, load_tokenizer, resolve_model
from common.rewards import RewardError, check_reward, load_reward
from common.schema import RolloutBatch, ScoredBatch, derive
from common.sequences import batched_response_logprobs, pack
from services.service import InputError, Service, check_token_ids


class ScorerService(Service):
    role = "scorer"

    @classmethod
    def check_inputs(cls, config: RunConfig) -> None:
        m = config.model
        resolve_model(m.reference or m.actor, m.cache_dir)
        check_reward(config)  # the function, or the judge's or the reward model's folder: its own factory

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        super().__init__(config, replica_id)
        m = config.model
        path = resolve_model(m.reference or m.actor, m.cache_dir)
        # Frozen: the runs a fleet's replica serves on one base share one copy (as do their reward models).
        self.reference_key = ("reference model", str(path), m.dtype_of("reference"), m.trust_remote_code, m.device)
        self.reference = FrozenModels.acquire(
            self.reference_key,
            lambda: load_actor(
                path, m.dtype_of("reference"), m.trust_remote_code, role="reference model", device=m.device
            ).requires_grad_(False),
        )
        self.pad_token_id = load_tokenizer(path, m.trust_remote_code).pad_token_id
        self.reward, reward_lineage = load_reward(config)
        self.lineage = {"reference.model": str(path), "scorer.replica": self.replica_id, **reward_lineage}
        if config.episodes:
            self.lineage["reward.environment_weight"] = config.reward.environment_weight

    def close(self) -> None:
        self.reward.close()
        if self.reference_key is not None:
            FrozenModels.release(self.reference_key)
            self.reference_key = None

    def take_up_new_log(self) -> bool:
        return True  # a record at a time, nothing kept between them

    @torch.no_grad()
    def process(self, message: RolloutBatch) -> list[ScoredBatch]:
        check_token_ids(message, self.reference, "reference model")
        ref_logprobs = self._reference_logprobs(message)
        try:
            scores = self.reward(message.prompt_text, message.response_text, message.prompt_label)
        except RewardError as exc:  # reward.on_error: stop the run, or set the batch aside and go on
            failed = f"batch {message.batch_id} (step {message.step}) cannot be scored: {exc}"
            if self.config.reward.on_error == "dead_letter":
                raise InputError(failed) from None
            raise RewardError(f"{failed} (reward.on_error: stop; dead_letter sets such a batch aside)") from exc
        if self.config.episodes:  # an episode's reward (its environment's, or its agent's) goes with its score
            scores = scores + self.config.reward.environment_weight * torch.from_numpy(message.environment_reward)
        lineage = {**self.lineage, **self.reward.last_call()}  # what the reward says of this batch (a judge's misses)
        return [
            derive(
                message,
                ScoredBatch,
                self.replica_id,
                lineage,
                scores=scores.numpy(),
                ref_logprobs=ref_logprobs.numpy(),
            )
        ]

    def _reference_logprobs(self, message: RolloutBatch) -> torch.Tensor:
        """``(N, T)`` log-probs of the responses under the frozen reference, at the sampling temperature; 0 where the
        model did not sample the token (padding, an environment's tokens)."""
        if message.rows == 0:  # a record that only settles groups dead-lettered on the way
            return torch.zeros(message.response_tokens.shape, dtype=torch.float32)
        tokens = torch.from_numpy(message.response_tokens)
        lengths = torch.from_numpy(message.response_lengths)
        prompt_lengths = torch.from_numpy(message.prompt_lengths)
        packed = pack(torch.from_numpy(message.prompt_tokens), prompt_lengths, tokens, lengths, self.pad_token_id)
        ref_logprobs = batched_response_logprobs(
            self.reference,
            packed,
            prompt_lengths,
            tokens,
            lengths,
            self.config.generation.temperature,
            max_tokens=self.config.model.max_tokens_per_microbatch,
        )
        return ref_logprobs.cpu() * torch.from_numpy(message.response_mask)
