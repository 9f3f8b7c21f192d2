"""Sampling responses with the actor: the generator's core, independent of how prompts arrive.

The transformers backend lives here; the vLLM backend (a later step) returns the same :class:`Samples`.
Behaviour log-probs are taken from the raw logits divided by the temperature, the same quantity the learner
recomputes, so that the two are comparable (top-p/top-k truncation is not reflected in either, as in verl).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.ppo import logprobs_from_logits
from common.sequences import lengths_to_mask, pack

__all__ = ["SamplingParams", "Samples", "sample_responses"]


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def lineage(self) -> dict:
        return {f"sampling.{k}": v for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Samples:
    """``N = B·n`` responses; row ``i`` answers prompt row ``group_index[i]``."""

    group_index: torch.Tensor  # (N,) long
    response_tokens: torch.Tensor  # (N, T) long, right-padded
    response_lengths: torch.Tensor  # (N,) long
    finished: torch.Tensor  # (N,) bool: ended with EOS
    behaviour_logprobs: torch.Tensor  # (N, T) float32, 0 at padding


@torch.no_grad()
def sample_responses(
    model,
    prompt_tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    params: SamplingParams,
    eos_token_id: int,
    pad_token_id: int,
) -> Samples:
    """Sample ``params.n`` responses for each of the ``B`` right-padded prompts ``(B, P)`` with ``model.generate``."""
    group_index = torch.arange(prompt_tokens.shape[0]).repeat_interleave(params.n)
    prompts = prompt_tokens[group_index]
    lengths = prompt_lengths[group_index]
    empty = torch.zeros((len(group_index), 0), dtype=torch.long)
    packed = pack(prompts, lengths, empty, torch.zeros_like(lengths), pad_token_id)
    torch.manual_seed(params.seed)
    out = model.generate(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        do_sample=True,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k or None,
        max_new_tokens=params.max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[:, packed.input_ids.shape[1] :]
    is_eos = tokens == eos_token_id
    finished = is_eos.any(dim=1)
    # The response runs up to and including its first EOS; what generate appends after it is padding.
    first_eos = torch.where(finished, is_eos.int().argmax(dim=1), torch.full_like(finished, tokens.shape[1], dtype=torch.long))
    response_lengths = torch.where(finished, first_eos + 1, first_eos)
    mask = lengths_to_mask(response_lengths, tokens.shape[1])
    logits = torch.stack(out.logits, dim=1).float() / params.temperature
    logprobs = logprobs_from_logits(logits, tokens) * mask
    tokens = torch.where(mask.bool(), tokens, pad_token_id)
    return Samples(group_index, tokens, response_lengths, finished, logprobs)
