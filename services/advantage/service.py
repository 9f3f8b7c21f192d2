"""advantage: scored → experience. Critic values, KL-shaped token rewards and advantages (``algorithm.estimator``).

With GAE it holds a read-only copy of the critic, refreshed from the learner's critic announcements; the learner's
current KL coefficient β travels in those announcements' lineage. A critic-free estimator (GRPO and its family)
loads no critic: values are zeros, the lineage names the estimator, and β comes from the actor's announcements.
"""

from __future__ import annotations

import logging
from functools import partial

import numpy as np
import torch

from common.config import RunConfig
from common.models import load_critic, load_tokenizer, resolve_model
from common.schema import ExperienceBatch, ScoredBatch, WeightAnnouncement, derive
from common.sequences import batched_response_values, pack
from common.weights import load_snapshot_into
from services.advantage.estimation import estimate_advantages, shaping_lineage
from services.service import Service, check_token_ids, load_announced_weights

log = logging.getLogger(__name__)


class AdvantageService(Service):
    role = "advantage"

    @classmethod
    def check_inputs(cls, config: RunConfig) -> None:
        m = config.model
        resolve_model((m.critic or m.actor) if config.algorithm.uses_critic else m.actor, m.cache_dir)

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        super().__init__(config, replica_id)
        m = config.model
        self.critic = None
        if config.algorithm.uses_critic:
            path = resolve_model(m.critic or m.actor, m.cache_dir)
            self.critic = load_critic(path, m.dtype_of("critic"), m.trust_remote_code, m.device).requires_grad_(False)
        else:
            path = resolve_model(m.actor, m.cache_dir)
            log.info("%s: %s needs no critic; none is loaded", self.replica_id, config.algorithm.estimator)
        self.pad_token_id = load_tokenizer(path, m.trust_remote_code).pad_token_id
        self.critic_version = 0
        self.kl_coef = config.algorithm.kl_coef

    @property
    def weight_models(self) -> tuple[str, ...]:
        return super().weight_models if self.critic is not None else ("actor",)  # for β alone

    def on_weights(self, announcement: WeightAnnouncement) -> bool:
        if self.critic is None:  # critic-free: the announcement brings β, and no weights to load
            self.kl_coef = float(announcement.lineage.get("kl_coef", self.kl_coef))
            return True
        if not load_announced_weights(
            partial(load_snapshot_into, self.critic), announcement, self.replica_id, self.critic_version
        ):
            return False
        self.critic_version = announcement.policy_version
        self.kl_coef = float(announcement.lineage.get("kl_coef", self.kl_coef))
        return True

    def take_up_new_log(self) -> bool:
        return True  # a record at a time; the learner announces its critic again on the new log

    @torch.no_grad()
    def process(self, message: ScoredBatch) -> list[ExperienceBatch]:
        tokens = torch.from_numpy(message.response_tokens)
        lengths = torch.from_numpy(message.response_lengths)
        # The model's tokens: an episode's environment tokens are context for the critic, never a step of GAE.
        mask = torch.from_numpy(message.response_mask)
        values = self._values(message, tokens, lengths) * mask
        algorithm = self.config.algorithm
        est = estimate_advantages(
            torch.from_numpy(message.scores),
            torch.from_numpy(message.behaviour_logprobs),
            torch.from_numpy(message.ref_logprobs),
            values,
            mask,
            torch.from_numpy(message.finished),
            torch.from_numpy(message.group_index),
            algorithm,
            self.kl_coef,
            self.config.max_response_tokens,
        )
        lineage = shaping_lineage(algorithm, self.kl_coef)
        if self.critic is not None:
            lineage["critic.version"] = self.critic_version
        no_signal = est.no_signal.numpy()
        experience = derive(
            message,
            ExperienceBatch,
            self.replica_id,
            lineage,
            values=values.numpy(),
            kl=est.kl.numpy(),
            token_rewards=est.token_rewards.numpy(),
            advantages=est.advantages.numpy(),
            returns=est.returns.numpy(),
            no_signal_groups=np.unique(message.group_index[no_signal]).astype(np.int64),
        )
        # Without its groups of no signal, the record still goes on (even empty): the learner counts what it settles.
        return [experience.take_rows(~no_signal) if no_signal.any() else experience]

    def _values(self, message: ScoredBatch, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``(N, T)`` critic values of the responses; zeros without a critic (or responses)."""
        if self.critic is None or message.rows == 0:
            return torch.zeros(tokens.shape, dtype=torch.float32)
        check_token_ids(message, self.critic, "critic")
        prompt_lengths = torch.from_numpy(message.prompt_lengths)
        packed = pack(torch.from_numpy(message.prompt_tokens), prompt_lengths, tokens, lengths, self.pad_token_id)
        values = batched_response_values(
            self.critic, packed, prompt_lengths, lengths, max_tokens=self.config.model.max_tokens_per_microbatch
        )
        return values.cpu()
