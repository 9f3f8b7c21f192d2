"""The trained models as ordinary transformers folders: ``<run dir>/final/{actor,critic}`` (a LoRA actor as a peft
adapter folder)."""

from __future__ import annotations

from pathlib import Path

import torch

from common.weights import is_adapted

__all__ = ["export_final_models", "merge_adapter"]


def export_final_models(run_dir: Path, models: dict[str, tuple[torch.nn.Module, dict | None]], tokenizer) -> Path:
    """Save each ``name: (model, full state)`` with the tokenizer under ``final/<name>``, so that any transformers
    loader (and vLLM) reads them. The state is the model's whole state dict (gathered from the ranks of a sharded
    learner); a state of None (the other ranks' share of that gathering) writes nothing."""
    final = Path(run_dir) / "final"
    for name, (model, state) in models.items():
        if state is None:
            continue
        if is_adapted(model):  # a LoRA actor: its adapter folder (adapter_config.json names the base model)
            model.save_pretrained(final / name)
        else:
            model.save_pretrained(final / name, state_dict=state)
        tokenizer.save_pretrained(final / name)
    return final


def merge_adapter(adapter: Path, out: Path, base: Path | None = None) -> Path:
    """A LoRA run's adapter folder (``final/actor``) merged into its base model: ``out``, an ordinary transformers
    folder (float32) that computes what the base with the adapter does, for any loader that knows no peft. ``base``:
    the base model's folder, by default the one the adapter names (``adapter_config.json``)."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoTokenizer

    from common.models import ModelLoadError, load_actor

    try:
        named = PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{adapter} is not a LoRA adapter folder (no adapter_config.json): {exc}") from None
    base = Path(base or named)
    if not base.is_dir():
        raise ModelLoadError(f"the adapter's base model {base} is not a folder here: give it with --base FOLDER")
    merged = PeftModel.from_pretrained(load_actor(base), str(adapter)).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(
        str(adapter if (Path(adapter) / "tokenizer_config.json").exists() else base)
    ).save_pretrained(out)
    return Path(out)
