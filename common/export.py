"""The trained models as ordinary transformers folders: ``<run dir>/final/{actor,critic}``."""

from __future__ import annotations

from pathlib import Path

__all__ = ["export_final_models"]


def export_final_models(run_dir: Path, actor, critic, tokenizer) -> Path:
    """Save actor and critic, each with the tokenizer, so that any transformers loader (and vLLM) reads them."""
    final = Path(run_dir) / "final"
    for name, model in (("actor", actor), ("critic", critic)):
        model.save_pretrained(final / name)
        tokenizer.save_pretrained(final / name)
    return final
