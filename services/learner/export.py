"""The trained models as ordinary transformers folders: ``<run dir>/final/{actor,critic}`` (a LoRA actor as a peft
adapter folder)."""

from __future__ import annotations

from pathlib import Path

import torch

from common.weights import is_adapted

__all__ = ["export_final_models"]


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
