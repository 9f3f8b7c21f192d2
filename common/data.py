"""Prompt datasets: a JSONL file read once (prompts and their labels), and a deterministic order of batches over
epochs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["DatasetError", "PromptDataset", "PromptSchedule", "load_prompts", "tokenize_prompts"]


class DatasetError(ValueError):
    """The prompt file is missing, a line is not an object with a non-empty 'prompt' string, or a 'label' is not a
    string."""


@dataclass(frozen=True)
class PromptDataset:
    """The rows of a prompt file: each prompt and its label, what a verifiable reward checks a response against
    (``{"prompt": ..., "label": ...}``; ``""`` where a row has none)."""

    texts: list[str]
    labels: list[str]

    def __len__(self) -> int:
        return len(self.texts)


def load_prompts(path: Path, setting: str = "data.prompts") -> PromptDataset:
    """The prompts (and labels) of a JSONL file; ``setting``: the setting that names it, for the errors."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(
            f"{setting}: cannot read prompt file {path} ({path.resolve()}): {exc.strerror or exc} (a relative path is "
            "taken from the config file's folder where it is there, else from the working directory)"
        ) from None
    texts, labels = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise DatasetError(f"{path}:{number}: expected an object with a non-empty string 'prompt'")
        if not isinstance(row.get("label", ""), str):
            raise DatasetError(f"{path}:{number}: 'label' must be a string (an answer is written as text: \"42\")")
        texts.append(row["prompt"])
        labels.append(row.get("label", ""))
    if not texts:
        raise DatasetError(f"{path} holds no prompts")
    return PromptDataset(texts, labels)


def tokenize_prompts(
    tokenizer, texts: list[str], max_tokens: int, chat_template: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded token ids ``(B, P)`` and lengths ``(B,)``; with ``chat_template`` each text is a user turn
    followed by the assistant's opening (instruct models). An over-long prompt keeps its end: the part the
    response continues."""
    if chat_template:
        token_lists = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            for text in texts
        ]
    else:
        token_lists = tokenizer(texts)["input_ids"]
    token_lists = [list(ids)[-max_tokens:] for ids in token_lists]
    lengths = np.array([len(ids) for ids in token_lists], dtype=np.int64)
    tokens = np.full((len(texts), max(int(lengths.max()), 1)), tokenizer.pad_token_id, dtype=np.int64)
    for row, ids in enumerate(token_lists):
        tokens[row, : len(ids)] = ids
    return tokens, lengths


class PromptSchedule:
    """Which dataset rows make up batch ``step``: epochs of a seeded permutation, batches that may span epochs.

    A pure function of ``step``, so a restarted feeder reproduces exactly the batches (and batch ids) it made
    before, and nothing is skipped or repeated at an epoch boundary.
    """

    def __init__(self, num_prompts: int, batch_size: int, shuffle: bool, seed: int):
        if batch_size > num_prompts:
            raise DatasetError(
                f"data.batch_size {batch_size} is larger than the {num_prompts} prompts of the dataset: "
                "a batch would hold the same prompt twice"
            )
        self.num_prompts, self.batch_size, self.shuffle, self.seed = num_prompts, batch_size, shuffle, seed

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def indices(self, step: int) -> np.ndarray:
        start = step * self.batch_size
        positions = np.arange(start, start + self.batch_size)
        epochs, offsets = np.divmod(positions, self.num_prompts)
        orders = {int(e): self._epoch_order(int(e)) for e in np.unique(epochs)}
        return np.array([orders[int(e)][o] for e, o in zip(epochs, offsets)], dtype=np.int64)
