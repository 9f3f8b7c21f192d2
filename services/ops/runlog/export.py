"""``streamppo export``: a run's rollouts and experience as a Parquet dataset, one row per response.

    <out>/rollouts.parquet     every response sampled (the rollouts topic), trained or not
    <out>/experience.parquet   every response that reached the learner, with its reward, advantages and update

Readable with ``datasets.load_dataset("parquet", data_files=...)`` and pandas. Token-level columns (log-probs,
versions, advantages, ...) are lists over the response's real tokens; ``lineage`` is the record's lineage as JSON.
A record seen twice (a batch re-delivered after a crash) gives its rows twice, each with its partition and offset.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.schema import ExperienceBatch, RolloutBatch, ScoredBatch, group_key
from services.ops.runlog.reader import LogReader
from services.ops.runlog.updates import trained_in

__all__ = ["export_parquet", "response_rows"]

# Token-level arrays of each schema, cut to the response's real tokens.
ROLLOUT_TOKENS = ("response_tokens", "response_mask", "behaviour_logprobs", "token_versions")
EXPERIENCE_TOKENS = (*ROLLOUT_TOKENS, "ref_logprobs", "values", "kl", "token_rewards", "advantages", "returns")


def response_rows(record, message, token_fields: tuple[str, ...]) -> list[dict]:
    """One row per response of ``message`` (a rollout batch or one of its extensions)."""
    lineage = message.lineage
    rows, samples = [], {}
    for i in range(len(message.response_text)):
        row_in_batch = int(message.group_index[i])
        length = int(message.response_lengths[i])
        model = message.response_mask[i, :length]
        versions = message.token_versions[i, :length][model]
        sample = samples[row_in_batch] = samples.get(row_in_batch, -1) + 1
        row = {
            "run_id": lineage.get("run.id", ""),
            "batch_id": message.batch_id,
            "step": int(message.step),
            "group": group_key(int(message.step), row_in_batch),
            "sample": sample,
            "prompt": message.prompt_text[i],
            "label": message.prompt_label[i],
            "response": message.response_text[i],
            "response_length": length,
            "model_tokens": len(versions),
            "turns": int(message.turns[i]),
            "environment_reward": float(message.environment_reward[i]),
            "finished": bool(message.finished[i]),
            "policy_version_min": int(versions.min()) if len(versions) else int(message.policy_version),
            "policy_version_max": int(versions.max()) if len(versions) else int(message.policy_version),
            "generator": lineage.get("generator.replica", ""),
            "producer": message.producer,
            "partition": record.partition,
            "offset": record.offset,
            "lineage": json.dumps(lineage, sort_keys=True, default=str),
        }
        if isinstance(message, ScoredBatch):
            row["reward"] = float(message.scores[i])
        if isinstance(message, ExperienceBatch):
            row["advantage_mean"] = float(message.advantages[i, :length][model].mean()) if model.any() else 0.0
            row["kl_sum"] = float(message.kl[i, :length].sum())
        for name in token_fields:
            row[name] = np.asarray(getattr(message, name)[i, :length]).tolist()
        rows.append(row)
    return rows


def export_parquet(reader: LogReader, out: Path, run_dir: Path | None = None) -> dict[str, int]:
    """Write both files under ``out``; returns the rows of each. ``run_dir`` (its metrics.jsonl) adds the update
    that trained each response."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    updates = trained_in(run_dir)
    counts = {}
    for name, message_type, token_fields in (
        ("rollouts", RolloutBatch, ROLLOUT_TOKENS),
        ("experience", ExperienceBatch, EXPERIENCE_TOKENS),
    ):
        rows = [
            row
            for record, message in reader.messages(message_type)
            for row in response_rows(record, message, token_fields)
        ]
        if message_type is ExperienceBatch:
            for row in rows:
                row["trained_in"] = updates.get(row["group"])
        pq.write_table(pa.Table.from_pylist(rows) if rows else pa.table({}), out / f"{name}.parquet")
        counts[name] = len(rows)
    return counts
