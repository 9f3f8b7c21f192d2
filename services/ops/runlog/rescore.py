"""``streamppo rescore``: a run's retained responses scored again by another reward (a function, a reward model or
a judge: the ``reward`` section of the given config), compared with the scores the run trained on, without
generating anything.

Reads the ``scored`` topic (each response's text, label and the score it had) and writes, under ``out``:
``rescore.jsonl`` (per response: its ids, texts, old and new score), ``summary.json`` (counts, means, Pearson and
Spearman correlation) and ``report.md`` (the summary and the largest disagreements, by rank, with their text).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from common.schema import ScoredBatch, group_key
from services.ops.runlog.reader import LogReader

__all__ = ["average_ranks", "compare_scores", "largest_disagreements", "rescore"]


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given the mean of the ranks they span (Spearman's convention)."""
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return ((ends - counts + 1 + ends) / 2.0)[inverse]


def _correlation(a: np.ndarray, b: np.ndarray) -> float | None:
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return None  # undefined for a constant side
    return float(np.corrcoef(a, b)[0, 1])


def compare_scores(old: np.ndarray, new: np.ndarray) -> dict:
    """Means, Pearson and Spearman correlation of two scorings of the same responses, and each response's rank
    disagreement ``(rank_new − rank_old) / n``."""
    old, new = np.asarray(old, dtype=np.float64), np.asarray(new, dtype=np.float64)
    rank_old, rank_new = average_ranks(old), average_ranks(new)
    return {
        "responses": len(old),
        "old_mean": float(old.mean()) if len(old) else None,
        "new_mean": float(new.mean()) if len(new) else None,
        "pearson": _correlation(old, new),
        "spearman": _correlation(rank_old, rank_new),
        "rank_shift": ((rank_new - rank_old) / max(len(old), 1)).tolist(),
    }


def rescore(reader: LogReader, reward: Callable, reward_id: dict, out: Path, top: int = 20) -> dict:
    """Score every response of the scored topic with ``reward(prompts, responses, labels)``; write the three
    files; returns the summary."""
    rows = []
    for record, batch in reader.messages(ScoredBatch):
        new = np.asarray(reward(batch.prompt_text, batch.response_text, batch.prompt_label), dtype=np.float64)
        for i in range(len(batch.response_text)):
            rows.append(
                {
                    "batch_id": batch.batch_id,
                    "group": group_key(batch.step, int(batch.group_index[i])),
                    "record": f"{record.topic}:{record.partition}:{record.offset}",
                    "prompt": batch.prompt_text[i],
                    "response": batch.response_text[i],
                    "label": batch.prompt_label[i],
                    "old": float(batch.scores[i]),
                    "new": float(new[i]),
                    "old_reward": {k: v for k, v in batch.lineage.items() if k.startswith("reward.")},
                }
            )
    comparison = compare_scores(np.array([r["old"] for r in rows]), np.array([r["new"] for r in rows]))
    for row, shift in zip(rows, comparison.pop("rank_shift")):
        row["rank_shift"] = shift
    summary = {**comparison, "new_reward": reward_id, "unreadable": [u.__dict__ for u in reader.unreadable]}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rescore.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.md").write_text(_report(summary, largest_disagreements(rows)[:top]))
    return summary


def largest_disagreements(rows: list[dict]) -> list[dict]:
    """The rows whose rank moved, the most first; among equal moves, rows whose scores many others share (ties,
    as a 0/1 reward gives) after those that stand alone."""
    shared = {}
    for row in rows:
        shared[row["old"], row["new"]] = shared.get((row["old"], row["new"]), 0) + 1
    moved = [row for row in rows if row["rank_shift"] != 0]
    return sorted(moved, key=lambda row: (-round(abs(row["rank_shift"]), 9), shared[row["old"], row["new"]]))


def _report(summary: dict, worst: list[dict]) -> str:
    def number(x):
        return "-" if x is None else f"{x:.4g}"

    lines = [
        "# Rescore",
        "",
        f"{summary['responses']} responses; new reward {summary['new_reward']}.",
        f"Mean score: old {number(summary['old_mean'])}, new {number(summary['new_mean'])}. "
        f"Pearson {number(summary['pearson'])}, Spearman {number(summary['spearman'])}.",
        "",
        "## Largest disagreements (rank shift = (new rank − old rank) / responses)",
        "",
        "| rank shift | old | new | group | prompt | response |",
        "|---|---|---|---|---|---|",
    ]
    for r in worst:
        cells = [r["prompt"], r["response"]]
        prompt, response = (c.replace("|", "\\|").replace("\n", " ")[:200] for c in cells)
        lines.append(
            f"| {r['rank_shift']:+.3f} | {r['old']:.4g} | {r['new']:.4g} | {r['group']} | {prompt} | {response} |"
        )
    return "\n".join(lines) + "\n"
