"""``streamppo replay``: the learner run again on a run's recorded experience, each update on exactly the groups the
run trained in it (in the order its ``metrics.jsonl`` lists them), from the start or from one of its checkpoints;
each version's snapshot digest is checked against the digest the run announced.

On CPU in float32 an update is a deterministic function of the weights, the optimizer and sampler state (all in a
checkpoint) and its experience, so every digest must match; one that does not names the first update whose input
or computation differs from the original's (an altered record, another library version, another machine's float
kernels). On GPUs, kernels that reduce in a nondeterministic order (atomics in scatter and some matmul and attention
backends), TF32, and another number of ranks or another sharding change the floats, and digests are not expected to
match there.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ConfigError, RunConfig
from common.schema import ExperienceBatch, WeightAnnouncement
from services.learner.experience import Experience
from services.learner.groups import groups_of
from services.ops.runlog.reader import LogReader
from services.ops.runlog.updates import update_lines

__all__ = ["ReplayResult", "replay"]


@dataclass
class ReplayResult:
    start: int  # the version replay started from (0: the initial weights)
    checked: list[dict] = field(default_factory=list)  # per version and model: announced, replayed, match

    @property
    def mismatches(self) -> list[dict]:
        return [c for c in self.checked if c["announced"] is not None and not c["match"]]


def announced_digests(reader: LogReader) -> dict[tuple[str, int], str]:
    """``(model, version) → digest`` of the run's announcements, the newest epoch's where a restarted learner
    announced a version again."""
    best: dict[tuple[str, int], tuple[int, str]] = {}
    for _, message in reader.messages(WeightAnnouncement):
        key, epoch = (message.model, message.policy_version), message.learner_epoch
        if key not in best or epoch >= best[key][0]:
            best[key] = (epoch, message.digest)
    return {key: digest for key, (_, digest) in best.items()}


def replay(
    reader: LogReader, config: RunConfig, run_dir: Path, out: Path, checkpoint: Path | None = None
) -> ReplayResult:
    """Replay the run whose log ``reader`` reads and whose metrics are in ``run_dir`` (``config``: its
    configuration) into ``out`` (a learner directory of its own: weight store, checkpoints)."""
    from services.learner.service import LearnerService  # loads torch and the models

    lines = update_lines(run_dir)
    if not lines:
        raise ConfigError(f"{run_dir}: no metrics.jsonl with updates to replay")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty: replay into a new folder")
    replay_config = _replay_config(config, out)
    if checkpoint is not None:
        if config.weights.full_every > 1:
            raise ConfigError(
                "replay from a checkpoint needs weights.full_every 1 (a delta names the snapshot before it, which "
                "the checkpoint does not hold); replay from the start"
            )
        target = replay_config.checkpoint_dir / Path(checkpoint).name
        shutil.copytree(checkpoint, target)
        (replay_config.checkpoint_dir / "LATEST").write_text(target.name + "\n")
    learner = LearnerService(replay_config, "replay")
    try:
        return _replay_updates(reader, learner, lines, announced_digests(reader), replay_config)
    finally:
        learner.close()


def _replay_config(config: RunConfig, out: Path) -> RunConfig:
    """The run's learner settings in a directory of its own, with nothing sent anywhere."""
    run = config.run.model_copy(update={"dir": out, "trackers": [], "archive_log": False, "resume": False})
    pipeline = config.pipeline.model_copy(update={"weight_store": None, "batch_store": None})
    learner = config.learner.model_copy(update={"checkpoint_dir": None})
    weights = config.weights.model_copy(update={"broadcast": None})
    return config.model_copy(update={"run": run, "pipeline": pipeline, "learner": learner, "weights": weights})


def _replay_updates(reader, learner, lines: list[dict], announced: dict, config: RunConfig) -> ReplayResult:
    result = ReplayResult(start=learner.trainer.version)
    todo = [line for line in lines if line["step"] > result.start]
    wanted = {group for line in todo for group in line["groups"]}
    groups = {}
    for _, message in reader.messages(ExperienceBatch):
        for group in groups_of(message):
            if group.key in wanted and group.key not in groups:  # a record delivered twice carries it twice
                groups[group.key] = group
    for line in todo:
        missing = [key for key in line["groups"] if key not in groups]
        if missing:
            raise LookupError(
                f"update {line['step']} trained groups the log no longer holds ({', '.join(missing[:5])}): "
                "expired by retention, or unreadable"
            )
        learner.trainer.train(Experience.concat([groups[key].experience for key in line["groups"]]))
        version = learner.trainer.version
        for name, _, _ in learner.trainer.models():
            snapshot = learner.publisher.store.save_state(
                name, version, learner.trainer.full_state(name, config.weights.dtype)
            )
            learner.publisher.store.prune(name, 2, version)
            expected = line.get("digests", {}).get(name, announced.get((name, version)))
            result.checked.append(
                {
                    "version": version,
                    "model": name,
                    "announced": expected,
                    "replayed": snapshot.digest,
                    "match": snapshot.digest == expected,
                }
            )
    return result
