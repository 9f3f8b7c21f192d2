"""The generator's samplers: :class:`TransformersSampler` (``generate``) and vLLM's (:mod:`.vllm_sampler`), both
:class:`common.sampling.Sampler`, and :func:`make_sampler`, which picks one."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import ClassVar

import torch

from common.broadcast import WeightReceiver
from common.generation import sample_responses
from common.models import add_lora, load_actor, lora_config
from common.sampling import Sampler, Samples, SamplingParams
from common.weights import load_snapshot_into, load_state_into

__all__ = ["AdapterHost", "GroupByGroup", "TransformersSampler", "make_sampler", "vllm_installed"]

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


class AdapterHost:
    """One base model in this process with LoRA adapters for several runs (the runs a fleet's generator replica
    serves): the base is loaded once, and a run's adapter is made active before its groups are sampled or its
    snapshots loaded (one thread samples: a fleet's runs take turns). Adapters are named after their runs."""

    _hosts: ClassVar[dict[tuple, AdapterHost]] = {}

    @classmethod
    def join(cls, model_dir: Path, dtype: str, trust_remote_code: bool, device: str, adapter: str, lora) -> AdapterHost:
        """The host of this base model in this process (loaded now if there is none), with a new adapter
        ``adapter`` (B = 0: the base's policy, version 0)."""
        key = (str(model_dir), dtype, trust_remote_code, device)
        host = cls._hosts.get(key)
        if host is None:
            host = cls._hosts[key] = cls(key, load_actor(model_dir, dtype, trust_remote_code, device=device))
        if adapter in host.adapters:
            raise ValueError(f"run {adapter} has an adapter on {model_dir} in this process already")
        if host.model is None:
            host.model = add_lora(host.base, lora, adapter).eval()
        else:
            host.model.add_adapter(adapter, lora_config(lora))
        host.adapters.add(adapter)
        log.info("LoRA adapter %s on %s: %d adapter(s) share its base weights", adapter, model_dir, len(host.adapters))
        return host

    def __init__(self, key: tuple, base: torch.nn.Module):
        self.key, self.base = key, base
        self.model = None  # the peft model, once the first adapter is added
        self.adapters: set[str] = set()

    def use(self, adapter: str) -> torch.nn.Module:
        """The model, with ``adapter`` active."""
        if self.model.active_adapter != adapter:
            self.model.set_adapter(adapter)
        return self.model

    def leave(self, adapter: str) -> None:
        """Drop ``adapter``; the base goes with the last one."""
        self.adapters.discard(adapter)
        if not self.adapters:
            self._hosts.pop(self.key, None)
            return
        self.use(next(iter(self.adapters)))  # peft deletes no active adapter
        self.model.delete_adapter(adapter)


class TransformersSampler(GroupByGroup):
    """The actor as a transformers model, sampled with ``generate``: slow, but needs nothing beyond the trainer. With
    LoRA the base model is shared by every run this process samples for (:class:`AdapterHost`), each run with its
    adapter (``adapter``: the run's id)."""

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
        adapter: str = "default",
    ):
        self.tokenizer = tokenizer  # for stop strings
        self.host, self.adapter = None, adapter
        if lora is not None:  # adapters to swap in; the base weights stay as loaded
            self.host = AdapterHost.join(model_dir, dtype, trust_remote_code, device, adapter, lora)
            self._model = self.host.model
        else:
            self._model = load_actor(model_dir, dtype, trust_remote_code, device=device)
        self.skeleton = self._model
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.receiver: WeightReceiver | None = None
        self.submitted: dict[str, tuple[list[int], SamplingParams]] = {}  # streaming: the groups not yet sampled

    @property
    def model(self) -> torch.nn.Module:
        """The actor, with this run's adapter active."""
        return self.host.use(self.adapter) if self.host is not None else self._model

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
        if self.host is not None:
            self.host.leave(self.adapter)
            self.host = None


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def make_sampler(config, model_dir: Path, tokenizer) -> Sampler:
    """The sampler ``config.generation.backend`` asks for; ``auto`` is vLLM when installed, else transformers."""
    backend = config.generation.backend
    if backend == "auto":
        backend = "vllm" if vllm_installed() else "transformers"
        if backend == "transformers":
            # A choice the install made (a lighter one), not a fault: said in plain words, not as a warning.
            log.info(
                "the generator samples with transformers, because vLLM is not installed here; "
                "`make setup` (deploy/install.py) installs the vLLM this machine takes, and it samples much faster"
            )
    if backend == "vllm":
        if not vllm_installed():
            raise RuntimeError(
                "generation.backend is 'vllm' but vLLM is not installed: `make setup` (deploy/install.py) "
                "installs the vLLM this machine takes, or set generation.backend=transformers"
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
            name=_adapter_name(config),
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
        adapter=_adapter_name(config),
    )


def _adapter_name(config) -> str:
    """The name of a run's adapter (and its requests) on a base model or engine that other runs of this process may
    share: peft takes no "." in a name, nor one within "lora_"."""
    return f"run-{config.run.run_id}".replace(".", "-dot-")
