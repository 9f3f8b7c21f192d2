"""Rule rewards the examples and tests train on, named in their configs as ``recipes.rewards:<function>``."""

from __future__ import annotations

import re
from collections.abc import Sequence

from common.rewards import RewardError

__all__ = ["final_number_matches", "no_score", "vowel_fraction"]


ANSWER_LETTERS = 8  # vowel_fraction: the letters an answer needs for its whole share


def vowel_fraction(prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """Synthetic task: the share of a response's letters that are vowels, times the share it has of
    :data:`ANSWER_LETTERS` letters (at most 1): a single vowel, or nothing, is not an answer (scored alone by its share,
    one vowel scored 1, and a policy learned to say nothing else)."""
    scores = []
    for response in responses:
        letters = [c for c in response.lower() if c.isalpha()]
        share = sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
        scores.append(share * min(1.0, len(letters) / ANSWER_LETTERS))
    return scores


def no_score(prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
    """0 for every response: for runs whose only signal is the KL to the reference (on-policy distillation)."""
    return [0.0] * len(responses)


def final_number_matches(prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str]) -> list[float]:
    """Verifiable reward: 1 where the last number in the response equals the label's number, else 0.

    As GSM8K is graded: thousands separators are ignored, ``7``, ``7.0`` and ``$7`` all match ``"7"``. A label that
    holds no number is a dataset error, not a zero: every response would score 0 and the run would learn nothing.
    """
    scores = []
    for response, label in zip(responses, labels, strict=True):
        expected = _last_number(label)
        if expected is None:
            raise RewardError(f"final_number_matches: the label {label!r} holds no number (does the dataset set one?)")
        scores.append(float(_last_number(response) == expected))
    return scores


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None
