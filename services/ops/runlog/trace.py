"""``streamppo trace``: what made an update, and which updates a prompt's samples trained.

Forward (``--update V``): the groups update ``V`` trained (the learner's ``metrics.jsonl``), and for each the
dataset row and text of its prompt, the generator replicas and the policy versions that sampled its tokens (per
token, counted), the scorer replica and reward (function, model or judge), the advantage replica and critic
version, and the topic, partition and offset of every record that carried it. Reverse (``--prompt ROW``): the
groups sampled for dataset row ``ROW`` and the updates that trained them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from common.schema import ExperienceBatch, PromptBatch, RolloutBatch, ScoredBatch, group_key
from services.ops.runlog.reader import LogReader, topic_of
from services.ops.runlog.updates import trained_in

__all__ = ["GroupTrace", "LogIndex", "format_trace", "trace_prompt", "trace_update"]

REWARD_KEYS = ("reward.function", "reward.model", "reward.judge")


@dataclass
class GroupTrace:
    group: str
    prompt_row: int | None = None  # the dataset row of its prompt
    prompt: str = ""
    generators: set[str] = field(default_factory=set)
    token_versions: Counter = field(default_factory=Counter)  # policy version -> response tokens it sampled
    scorers: set[str] = field(default_factory=set)
    rewards: set[str] = field(default_factory=set)
    advantage: set[str] = field(default_factory=set)
    critic_versions: set[int] = field(default_factory=set)
    scores: list[float] = field(default_factory=list)  # its responses' scores (as trained on)
    records: list[str] = field(default_factory=list)  # "<topic>:<partition>:<offset>" of every record carrying it
    trained_in: int | None = None

    @property
    def reward(self) -> float | None:
        """The mean score of its responses (None before it was scored)."""
        return sum(self.scores) / len(self.scores) if self.scores else None

    def as_json(self) -> dict:
        return {
            "group": self.group,
            "prompt_row": self.prompt_row,
            "prompt": self.prompt,
            "generators": sorted(self.generators),
            "token_versions": {str(v): n for v, n in sorted(self.token_versions.items())},
            "scorers": sorted(self.scorers),
            "rewards": sorted(self.rewards),
            "advantage": sorted(self.advantage),
            "critic_versions": sorted(self.critic_versions),
            "scores": self.scores,
            "reward": self.reward,
            "records": self.records,
            "trained_in": self.trained_in,
        }


class LogIndex:
    """One pass over the log's data topics, every group's trace kept (a trace of a run's log is of its size in
    groups, not in tokens)."""

    def __init__(self, reader: LogReader, run_dir: Path | None):
        self.groups: dict[str, GroupTrace] = {}
        self.prompt_groups: dict[int, list[str]] = defaultdict(list)  # dataset row -> its groups
        self.updates: dict[int, list[str]] = defaultdict(list)
        for group, update in trained_in(run_dir).items():
            self.updates[update].append(group)
            self.trace(group).trained_in = update
        for record, batch in reader.messages(PromptBatch):
            for row, (index, text) in enumerate(zip(batch.prompt_index, batch.prompt_text)):
                trace = self.trace(group_key(batch.step, row))
                trace.prompt_row, trace.prompt = int(index), text
                if trace.group not in self.prompt_groups[int(index)]:
                    self.prompt_groups[int(index)].append(trace.group)
                trace.records.append(f"{record.topic}:{record.partition}:{record.offset}")
        for message_type in (RolloutBatch, ScoredBatch, ExperienceBatch):
            for record, batch in reader.messages(message_type):
                self._add(record, batch, message_type)
        self.unreadable = reader.unreadable

    def trace(self, group: str) -> GroupTrace:
        return self.groups.setdefault(group, GroupTrace(group))

    def _add(self, record, batch, message_type) -> None:
        lineage = batch.lineage
        for row in sorted({int(g) for g in batch.group_index}):
            trace = self.trace(group_key(batch.step, row))
            trace.records.append(f"{topic_of(message_type)}:{record.partition}:{record.offset}")
            if message_type is RolloutBatch:
                trace.generators.add(lineage.get("generator.replica", batch.producer))
                for i in (batch.group_index == row).nonzero()[0]:
                    trace.token_versions.update(int(v) for v in batch.token_versions[i][batch.response_mask[i]])
            elif message_type is ScoredBatch:
                trace.scorers.add(batch.producer)
                trace.rewards.update(f"{key}={lineage[key]}" for key in REWARD_KEYS if key in lineage)
                if not trace.scores:  # a group scored again (a re-delivery) keeps its first scores
                    trace.scores = [float(x) for x in batch.scores[batch.group_index == row]]
            else:
                trace.advantage.add(batch.producer)
                if "critic.version" in lineage:
                    trace.critic_versions.add(int(lineage["critic.version"]))


def trace_update(index: LogIndex, update: int) -> dict:
    """What made update ``update``: its groups' traces and their union."""
    groups = [index.groups[g] for g in index.updates.get(update, [])]
    if not groups:
        known = sorted(index.updates)
        raise LookupError(
            f"no update {update} in the run's metrics (updates {known[0]}..{known[-1]})" if known else "no updates"
        )
    versions: Counter = Counter()
    for g in groups:
        versions.update(g.token_versions)
    return {
        "update": update,
        "groups": [g.as_json() for g in groups],
        "prompt_rows": sorted({g.prompt_row for g in groups if g.prompt_row is not None}),
        "generators": sorted(set().union(*(g.generators for g in groups))),
        "token_versions": {str(v): n for v, n in sorted(versions.items())},
        "scorers": sorted(set().union(*(g.scorers for g in groups))),
        "rewards": sorted(set().union(*(g.rewards for g in groups))),
        "advantage": sorted(set().union(*(g.advantage for g in groups))),
        "records": sorted({r for g in groups for r in g.records}),
    }


def trace_prompt(index: LogIndex, row: int) -> dict:
    """Which groups were sampled for dataset row ``row`` and which updates trained them."""
    groups = [index.groups[g] for g in index.prompt_groups.get(row, [])]
    if not groups:
        raise LookupError(f"dataset row {row} was not sampled in this log")
    return {
        "prompt_row": row,
        "prompt": groups[0].prompt,
        "groups": {g.group: g.trained_in for g in groups},
        "updates": sorted({g.trained_in for g in groups if g.trained_in is not None}),
    }


def format_trace(answer: dict) -> str:
    """Plain text of :func:`trace_update`'s or :func:`trace_prompt`'s answer."""
    if "update" in answer:
        steps = sorted({int(g["group"].split("/")[0]) for g in answer["groups"]})
        lines = [
            f"update {answer['update']} (updates count from 1): {len(answer['groups'])} groups of prompt batches "
            f"{steps} (steps count from 0; a group is <step>/<row>), from dataset rows {answer['prompt_rows']}",
            f"  generators: {', '.join(answer['generators'])}",
            "  tokens per policy version: " + ", ".join(f"v{v}: {n}" for v, n in answer["token_versions"].items()),
            f"  scorers: {', '.join(answer['scorers'])}; reward: {', '.join(answer['rewards'])}",
            f"  advantage: {', '.join(answer['advantage'])}",
            "  groups:",
        ]
        for g in answer["groups"]:
            versions = ", ".join(f"v{v}: {n}" for v, n in g["token_versions"].items())
            reward = "-" if g["reward"] is None else f"{g['reward']:.4g}"
            lines.append(
                f"    {g['group']} (dataset row {g['prompt_row']}) reward {reward} over {len(g['scores'])} responses; "
                f"tokens {versions}; records {' '.join(g['records'])}"
            )
            if g.get("prompt"):
                lines.append(f"      prompt: {_shortened(g['prompt'])!r}")
        return "\n".join(lines)
    lines = [f"dataset row {answer['prompt_row']}: {answer['prompt']!r}"]
    for group, update in answer["groups"].items():
        lines.append(f"  group {group}: " + (f"trained in update {update}" if update is not None else "not trained"))
    return "\n".join(lines)


def _shortened(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
