"""One rollouts record, however its groups were sampled: by the generator (a prompt's ``n`` samples, or a model's
turns of an episode with an environment) or through the gateway (the rows of agents' episodes).

The record is as old as its oldest token the model sampled (its header's ``policy_version``): the staleness rule
judges a group by it (docs/ARCHITECTURE.md, "The staleness rule").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.schema import PromptBatch, RolloutBatch, new_header

__all__ = ["SampledRows", "rollout_batch"]


@dataclass(frozen=True)
class SampledRows:
    """``N`` rows of one prompt batch's groups as sampled, ``P`` prompt and ``T`` response tokens wide (padded)."""

    group_index: np.ndarray  # (N,) int64: each row's prompt, a row of the prompt batch
    prompt_tokens: np.ndarray  # (N, P) int64
    prompt_lengths: np.ndarray  # (N,) int64
    response_tokens: np.ndarray  # (N, T) int64
    response_lengths: np.ndarray  # (N,) int64
    response_text: list[str]  # N
    finished: np.ndarray  # (N,) bool: ended by EOS or a stop (not cut at the length limit)
    behaviour_logprobs: np.ndarray  # (N, T) float32: of the distribution each token was drawn from
    token_versions: np.ndarray  # (N, T) int32: the actor version that sampled each token
    response_mask: np.ndarray  # (N, T) bool: the tokens the model sampled (what trains)
    turns: np.ndarray  # (N,) int64: the model's turns in each row
    environment_reward: np.ndarray  # (N,) float32: what each episode's environment (or agent) returned


def rollout_batch(
    message: PromptBatch,
    rows: SampledRows,
    batch_id: str,
    producer: str,
    lineage: dict,
    version: int,
    dead_lettered_groups: tuple[int, ...] = (),
) -> RolloutBatch:
    """The rollouts record of ``rows`` (of ``message``'s prompts): as old as the oldest token the model sampled, or
    ``version`` when it sampled none (a group dead-lettered whole, ``dead_lettered_groups``, whose record is empty)."""
    mask, versions = rows.response_mask, rows.token_versions
    oldest = int(versions[mask].min()) if mask.any() else version
    group_index = np.asarray(rows.group_index, np.int64)
    return RolloutBatch(
        **new_header(batch_id, producer, oldest, lineage),
        step=message.step,
        group_index=group_index,
        prompt_text=[message.prompt_text[i] for i in group_index],
        prompt_label=[message.prompt_label[i] for i in group_index],
        response_text=list(rows.response_text),
        prompt_tokens=np.asarray(rows.prompt_tokens, np.int64),
        prompt_lengths=np.asarray(rows.prompt_lengths, np.int64),
        response_tokens=np.asarray(rows.response_tokens, np.int64),
        response_lengths=np.asarray(rows.response_lengths, np.int64),
        finished=np.asarray(rows.finished, bool),
        behaviour_logprobs=np.asarray(rows.behaviour_logprobs, np.float32),
        token_versions=np.asarray(versions, np.int32),
        response_mask=np.asarray(mask, bool),
        turns=np.asarray(rows.turns, np.int64),
        environment_reward=np.asarray(rows.environment_reward, np.float32),
        dead_lettered_groups=np.asarray(dead_lettered_groups, np.int64),
    )
