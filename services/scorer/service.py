"""scorer: rollouts → scored. The reward model's score and the frozen reference model's log-probs.

Both models are frozen, so scorer replicas are interchangeable and scale on their own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.config import RunConfig
from common.models import FrozenModels, load_actor, load_reward_model, load_tokenizer, resolve_model
from common.rewards import RewardError, RewardFunction, RewardModelScorer
from common.schema import RolloutBatch, ScoredBatch, derive
from common.sequences import batched_response_logprobs, pack
from services.scorer.judge import JudgeScorer, judge_id, judge_writer
from services.service import InputError, Service, check_token_ids


def load_reward(config: RunConfig) -> tuple[Callable, dict]:
    """The reward ``config.reward`` names (a function, a judge or a reward model), called with prompts, responses
    and labels, and the lineage that says which it is."""
    m = config.model
    if config.reward.function is not None:
        return RewardFunction(config.reward.function), {"reward.function": config.reward.function}
    if config.reward.judge is not None:
        judge = config.reward.judge
        judge_path = resolve_model(judge.model, m.cache_dir)
        write = judge_writer(judge, judge_path, m.dtype_of("reward"), m.device, m.trust_remote_code, config.run.seed)
        scorer = JudgeScorer(
            write,
            judge.template,
            judge.pattern,
            judge.on_unparsed,
            judge.default_score,
            config.reward.batch_size,
            name=f"judge {judge_path.name}",
        )
        return scorer, {"reward.judge": judge_id(judge_path, judge.template, judge.pattern)}
    rm_path = resolve_model(config.reward.model, m.cache_dir)
    key = ("reward model", str(rm_path), m.dtype_of("reward"), m.trust_remote_code, m.device)
    model = FrozenModels.acquire(
        key, lambda: load_reward_model(rm_path, m.dtype_of("reward"), m.trust_remote_code, m.device)
    )
    tokenizer = load_tokenizer(rm_path, m.trust_remote_code)
    release = lambda: FrozenModels.release(key)  # noqa: E731
    scorer = RewardModelScorer(model, tokenizer, batch_size=config.reward.batch_size, release=release)
    return scorer, {"reward.model": str(rm_path)}


class ScorerService(Service):
    role = "scorer"

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
        if isinstance(self.reward, JudgeScorer | RewardModelScorer):
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
        lineage = self.lineage
        if isinstance(self.reward, JudgeScorer):  # how many of this batch's answers got the default score
            lineage = {**lineage, "reward.judge.unparsed": self.reward.last_unparsed}
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
