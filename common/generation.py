"""Sampling responses with a transformers actor (``generate``), with the log-probs of the tokens drawn: what the
generator's transformers backend samples with (``services/generator/samplers.py``), and what the learner answers its
evaluation prompts with.

Behaviour log-probs are those of the distribution each token was actually drawn from: the logits divided by the
temperature, with top-k / top-p truncation applied and renormalised. That is vLLM's ``processed_logprobs`` and
the log-softmax of transformers' processed ``scores``; with top_k 0 and top_p 1 it equals the learner's own
recomputation ``log_softmax(logits / T)``.
"""

from __future__ import annotations

import torch

from common.sampling import Samples, SamplingParams
from common.sequences import lengths_to_mask, pack

__all__ = ["sample_responses"]


@torch.no_grad()
def sample_responses(
    model,
    prompt_tokens: torch.Tensor,
    prompt_lengths: torch.Tensor,
    params: SamplingParams,
    eos_token_id: int,
    pad_token_id: int,
    tokenizer=None,
) -> Samples:
    """Sample ``params.n`` responses for each of the ``B`` right-padded prompts ``(B, P)`` with ``model.generate``.
    ``params.stop`` needs the ``tokenizer`` (transformers matches stop strings on tokens); a response that ends at
    one is not ``finished`` (no EOS), and rows of a batch that stop early are padded, so sample one at a time."""
    group_index = torch.arange(prompt_tokens.shape[0]).repeat_interleave(params.n)
    prompts = prompt_tokens[group_index]
    lengths = prompt_lengths[group_index]
    empty = torch.zeros((len(group_index), 0), dtype=torch.long)
    packed = pack(prompts, lengths, empty, torch.zeros_like(lengths), pad_token_id)
    if params.seed is not None:
        torch.manual_seed(params.seed)
    out = model.generate(
        input_ids=packed.input_ids.to(model.device),
        attention_mask=packed.attention_mask.to(model.device),
        # top_k 0 switches the warper off (None would fall back to the generation config's 50). Temperature 0 is
        # greedy, as in vLLM (transformers refuses it for sampling), and the log-probs are the model's own.
        **(
            {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
            if params.temperature > 0
            else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        ),
        max_new_tokens=params.max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        output_scores=True,
        return_dict_in_generate=True,
        **({"stop_strings": list(params.stop), "tokenizer": tokenizer} if params.stop else {}),
    )
    tokens = out.sequences[:, packed.input_ids.shape[1] :].cpu()
    is_eos = tokens == eos_token_id
    finished = is_eos.any(dim=1)
    # The response runs up to and including its first EOS; what generate appends after it is padding.
    first_eos = torch.where(
        finished, is_eos.int().argmax(dim=1), torch.full_like(finished, tokens.shape[1], dtype=torch.long)
    )
    response_lengths = torch.where(finished, first_eos + 1, first_eos)
    mask = lengths_to_mask(response_lengths, tokens.shape[1])
    # scores: after temperature and truncation, -inf outside the kept set; the sampled token is always inside.
    scores = torch.stack(out.scores, dim=1).float()
    logprobs = scores.log_softmax(-1).gather(-1, tokens.to(scores.device).unsqueeze(-1)).squeeze(-1).cpu()
    logprobs = torch.where(mask.bool(), logprobs, 0.0)
    tokens = torch.where(mask.bool(), tokens, pad_token_id)
    return Samples(group_index, tokens, response_lengths, finished, logprobs)
