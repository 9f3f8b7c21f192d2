"""Loading the four models, and the builtin models that need no hub.

The actor and reference are causal LMs; the critic is the same kind of backbone with a one-output token
classification head (``V(s_t)`` at every position), the reward model a one-label sequence classifier. All come
from transformers' Auto classes: no model code is written here.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

log = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_MODELS_GROUP",
    "builtin_models",
    "FrozenModels",
    "ModelLoadError",
    "actor_skeleton",
    "add_lora",
    "enable_activation_checkpointing",
    "load_actor",
    "load_critic",
    "load_reward_model",
    "load_tokenizer",
    "resolve_model",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The entry-point group under which an installed package registers the models ``builtin:<name>`` names: each entry
# a mapping of name -> (build(folder), revision). streamppo's own are the recipes' (pyproject.toml).
BUILTIN_MODELS_GROUP = "streamppo.models"


@functools.cache
def builtin_models() -> dict[str, tuple[Callable[[Path], None], int]]:
    """Every model ``builtin:<name>`` can name, as the installed packages register them (:data:`BUILTIN_MODELS_GROUP`):
    name -> (builder, revision). The revision is part of the cache folder's name, so a changed builder never leaves an
    old build in use."""
    found: dict = {}
    for entry in importlib.metadata.entry_points(group=BUILTIN_MODELS_GROUP):
        found.update(entry.load())
    return found


def _build_builtin(name: str, build, directory: Path) -> None:
    log.info("preparing builtin model %s in %s (once)", name, directory)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=directory.parent))
    try:
        build(tmp)
        os.rename(tmp, directory)
    except ModuleNotFoundError as exc:  # a package the recipe needs (its message says which)
        raise ModelLoadError(f"builtin model {name}: {exc}") from exc
    except OSError:  # built by another machine on a shared filesystem, where the lock may not reach: the first wins
        if not directory.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded; the message names the path and the role."""


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """Turn a model spec into a local folder: ``builtin:<name>`` is prepared into ``cache_dir`` once."""
    if spec.startswith("builtin:"):
        name, known = spec.removeprefix("builtin:"), builtin_models()
        if name not in known:
            raise ModelLoadError(
                f"unknown builtin model {name!r}; known: {sorted(known)} (registered by installed packages under the "
                f"entry-point group {BUILTIN_MODELS_GROUP}: is streamppo installed, `make setup`?)"
            )
        build, revision = known[name]
        directory = Path(cache_dir) / "models" / f"{name}-r{revision}"
        if not directory.is_dir():
            directory.parent.mkdir(parents=True, exist_ok=True)
            # Services started together on a fresh cache: one builds it, the others wait for it (a lock the
            # kernel lets go of if its holder dies). A half-built folder never has the final name.
            with open(directory.parent / f".{name}-r{revision}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not directory.is_dir():
                    _build_builtin(name, build, directory)
        return directory
    path = Path(spec)
    if not (path / "config.json").is_file():
        if not path.exists() and _looks_like_a_hub_id(spec):
            raise ModelLoadError(
                f"model {spec!r} is a Hugging Face hub id, not a folder here: streamppo loads models from local "
                f"folders and downloads nothing. Download it where the hub answers (huggingface-cli download {spec} "
                f"--local-dir DIR, or from your Hugging Face cache: ~/.cache/huggingface/hub/models--"
                f"{spec.replace('/', '--')}/snapshots/<revision>) and give that folder; see docs/your-model-and-data.md"
            )
        what = "has no config.json" if path.is_dir() else "not found"
        raise ModelLoadError(
            f"model folder {path} {what} (a transformers model folder: config.json, weights, tokenizer; "
            "or builtin:<name>, `streamppo models list`)"
        )
    return path


# --------------------------------------------------------------------------------------------- loaders


def _looks_like_a_hub_id(spec: str) -> bool:
    """``organisation/name``: what the hub calls a model (a relative folder of two parts would exist)."""
    parts = spec.split("/")
    return len(parts) == 2 and all(part and not part.startswith(".") for part in parts) and "\\" not in spec


def _devices_here() -> str:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        return " (this machine has no CUDA device: model.device cpu)"
    return f" (this machine has {count} CUDA device(s): model.device cpu, or cuda:0 to cuda:{count - 1})"


def _load(auto_class, path: Path, role: str, dtype: str, trust_remote_code: bool, device: str = "cpu", **kwargs):
    try:
        model = auto_class.from_pretrained(
            path, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
        ).to(device)
    except (OSError, ValueError, KeyError, RuntimeError, AssertionError) as exc:
        # AssertionError: torch's "not compiled with CUDA enabled" when model.device asks for a GPU it lacks (a
        # CUDA build of torch says "no NVIDIA driver" instead, RuntimeError): either way, say what there is.
        there = _devices_here() if device != "cpu" else ""
        raise ModelLoadError(f"cannot load the {role} from {path} onto {device}: {exc}{there}") from exc
    # Dropout would make π_old and π_new differ on identical weights; RLHF trains with it off.
    model.eval()
    return model


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_actor(
    path: Path, dtype: str = "float32", trust_remote_code: bool = False, role: str = "actor", device: str = "cpu"
):
    """A causal LM (actor or reference)."""
    return _load(AutoModelForCausalLM, path, role, dtype, trust_remote_code, device)


def add_lora(model, lora, adapter: str = "default"):
    """``model`` with LoRA adapters (``lora``: :class:`common.config.LoraOptions`) on its target modules, peft's
    way, named ``adapter``: only the adapters train, and at start (B = 0) the model computes what the base does."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(lora), adapter_name=adapter)
    except ValueError as exc:  # e.g. target modules the model does not have
        raise ModelLoadError(f"model.lora: {exc}") from None


def lora_config(lora):
    """peft's ``LoraConfig`` of ``lora`` (:class:`common.config.LoraOptions`)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )


def actor_skeleton(path: Path, trust_remote_code: bool = False):
    """The actor's module tree on the meta device: parameter names, shapes and tying, without weights."""
    config = _config(path, trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def load_critic(path: Path, dtype: str = "float32", trust_remote_code: bool = False, device: str = "cpu"):
    """The critic: the backbone at ``path`` with a scalar head at every position.

    A folder saved as a critic keeps its head; a causal-LM folder gets a new head initialised to zero, so the
    first values are 0 rather than noise.
    """
    config = _config(path, trust_remote_code)
    is_critic = any(arch.endswith("ForTokenClassification") for arch in (config.architectures or []))
    config.num_labels = 1
    config.classifier_dropout = 0.0  # read by the token-classification head of every family that has dropout there
    model = _load(AutoModelForTokenClassification, path, "critic", dtype, trust_remote_code, device, config=config)
    if not is_critic:
        head = getattr(model, "score", None) or model.classifier  # the head's name varies by family
        with torch.no_grad():
            head.weight.zero_()
            if getattr(head, "bias", None) is not None:
                head.bias.zero_()
    return model


def load_reward_model(path: Path, dtype: str = "float32", trust_remote_code: bool = False, device: str = "cpu"):
    """A one-label sequence classifier; frozen."""
    model = _load(
        AutoModelForSequenceClassification, path, "reward model", dtype, trust_remote_code, device, num_labels=1
    )
    model.requires_grad_(False)
    return model


class FrozenModels:
    """Frozen models (a reference model, a reward model) loaded once per process and shared by every service in it
    that asks for the same one: a fleet's replica serving several runs on one base holds one copy. Nothing writes a
    frozen model's weights, so sharing changes no result. Each :meth:`acquire` is matched by a :meth:`release`; the
    model goes with its last user."""

    _models: ClassVar[dict[tuple, list]] = {}  # key -> [model, users]

    @classmethod
    def acquire(cls, key: tuple, load: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """The model of ``key`` (``load()`` it unless this process has it)."""
        held = cls._models.get(key)
        if held is None:
            held = cls._models[key] = [load(), 0]
        held[1] += 1
        if held[1] > 1:
            log.info("%s: one copy in this process, shared by %d services", key[1], held[1])
        return held[0]

    @classmethod
    def release(cls, key: tuple) -> None:
        held = cls._models.get(key)
        if held is not None:
            held[1] -= 1
            if held[1] <= 0:
                del cls._models[key]


def _config(path: Path, trust_remote_code: bool):
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the model config in {path}: {exc}") from exc


def enable_activation_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Recompute each decoder layer's activations in the backward pass instead of keeping them.

    transformers recomputes only in training mode, so the model is put in it, with its dropout layers kept off:
    a PPO update must see the same function as the π_old pass. (Attention dropout is read from the config; the
    models this targets, Llama, Qwen, Mistral, set it to 0.)
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.eval()
    return model
