"""A learner that dies and restarts resumes from its checkpoint: nothing lost, nothing applied twice."""

import dataclasses
import json

import pytest
import torch
from helpers import publish, read_messages, sampled_by, started

from common.schema import encode
from common.storage import NoSpaceError, write_or_explain
from services.advantage import AdvantageService
from services.feeder import FeederService
from services.generator import GeneratorService
from services.learner import LearnerService
from services.learner.experience import Experience
from services.roles import pipeline_topics
from services.scorer import ScorerService
from services.service import Dropped, InputError, Progress
from services.transport import MemoryBus


@pytest.fixture
def config(make_config):
    # Staleness 3 lets all four batches be sampled up front by v0, without a running learner.
    return make_config(
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=6",
        "learner.mini_batch_size=2",
        "pipeline.max_staleness=3",
    )


@pytest.fixture
def experience(config):
    feeder, generator, scorer, advantage = (
        FeederService(config),
        GeneratorService(config),
        ScorerService(config),
        AdvantageService(config),
    )
    return [advantage.process(scorer.process(generator.process(feeder.batch(step))[0])[0])[0] for step in range(4)]


def apply(learner, message, offset, handled=()):
    """What the runner does with one record: process it, then ask whether the state is durable (checkpointing if
    it is due) before committing ``offset``; ``handled``: the ids the runner remembers before this one."""
    outputs = learner.process(message)
    return outputs, learner.make_durable(Progress({"experience/0": offset + 1}, [*handled, message.batch_id]))


def served(config, bus):
    """A learner served by the runner over ``bus`` (its experience topic of one partition)."""
    return started(LearnerService(config), bus)


def send(bus, messages):
    publish(bus, "experience", *(encode(message) for message in messages), partition=0)


def weights(learner):
    return {k: v.clone() for k, v in learner.trainer.state_dict()["actor"].items()}


def test_a_restarted_learner_continues_exactly_where_it_stopped(config, experience, tmp_path):
    uninterrupted = LearnerService(
        config.model_copy(update={"run": config.run.model_copy(update={"dir": tmp_path / "a"})})
    )
    for offset, message in enumerate(experience):
        apply(uninterrupted, message, offset)

    bus = MemoryBus()
    bus.create_topics(pipeline_topics(partitions=1))
    send(bus, experience)
    first = served(config, bus)
    assert first.poll_once() and first.counters["processed"] == 1
    first.work.commit = lambda record: None  # killed after its second update was checkpointed, before the commit
    assert first.poll_once() and first.counters["processed"] == 2
    first.work.close()  # the process is gone: its group membership ends, its uncommitted input comes back

    resumed = served(config, bus)
    learner = resumed.service
    assert learner.trainer.version == 2 and learner.updates == 2
    assert learner.restored().offsets == {"experience/0": 2}
    assert [a.policy_version for a in read_messages(bus, "weights")[-2:]] == [2, 2], "re-announces the resumed version"
    assert resumed.poll_once() and resumed.counters["duplicates"] == 1, "the re-delivered batch is recognised"
    while resumed.poll_once():
        pass
    assert learner.trainer.version == 4 and learner.updates == 4 and resumed.counters["processed"] == 2
    expected, actual = weights(uninterrupted), weights(learner)
    assert all(torch.equal(expected[k], actual[k]) for k in expected), "same weights as a run that never stopped"


def test_on_a_new_log_the_learner_checkpoints_first_and_the_feeder_publishes_again_what_it_did_not_settle(
    config, experience
):
    """The broker lost the log after the learner applied two batches, checkpointing every third update only. The
    learner goes on on the new log with what it applied (checkpointed first, announced there with what it settled),
    the feeder publishes again from there once it hears the learner on the new log, and the batches applied are
    recognised if the old log's records come again."""
    config = config.model_copy(
        update={
            "learner": config.learner.model_copy(update={"checkpoint_every": 3}),
            "run": config.run.model_copy(update={"steps": 4}),  # one prompt batch an update: four in all
        }
    )
    old, new = MemoryBus(), MemoryBus()
    for log in (old, new):
        log.create_topics(pipeline_topics(partitions=1))
    feeder = started(FeederService(config), old)
    assert [m.step for m in read_messages(old, "prompts")] == [0, 1, 2, 3]
    send(old, experience[:2])
    learner = served(config, old)
    while learner.poll_once():
        pass
    assert learner.service.updates == 2 and not (config.checkpoint_dir / "LATEST").exists(), "not yet checkpointed"

    for runner in (learner, feeder):
        runner.release_lost_log()
        assert runner.service.take_up_new_log()
    meta = json.loads(
        (config.checkpoint_dir / (config.checkpoint_dir / "LATEST").read_text() / "learner.json").read_text()
    )
    assert meta["updates"] == 2 and meta["ledger"]["below"] == 2, "what it applied was checkpointed first"
    feeder = started(feeder.service, new)
    assert feeder.poll_once() is False and read_messages(new, "prompts") == [], "the feeder waits for the learner"
    learner = started(learner.service, new)
    announced = read_messages(new, "weights")
    assert {a.policy_version for a in announced} == {2} and {a.lineage["learner.settled"] for a in announced} == {2}
    assert feeder.poll_once() and [m.step for m in read_messages(new, "prompts")] == [2, 3]
    assert not feeder.service.done(), "the learner has not settled them yet"
    send(new, experience)  # the applied batches too, as a generator of the old log might send them
    while learner.poll_once():
        pass
    assert learner.service.updates == 4 and learner.counters["duplicates"] == 2
    feeder.poll_once()
    assert feeder.service.done(), "every prompt batch settled: the feeder is done"


def test_the_checkpoint_keeps_a_bounded_memory_of_batch_ids(config, experience):
    config = config.model_copy(update={"pipeline": config.pipeline.model_copy(update={"dedupe_window": 2})})
    bus = MemoryBus()
    bus.create_topics(pipeline_topics(partitions=1))
    send(bus, experience)
    first = served(config, bus)
    while first.poll_once():
        pass
    first.work.close()
    resumed = served(config, bus)
    assert resumed.recent.to_list() == experience[-1].idempotency_keys(), "the last two group keys, not all eight"
    send(bus, experience[-1:])  # a re-delivery
    assert resumed.poll_once() and resumed.counters["duplicates"] == 1 and resumed.service.trainer.version == 4
    meta = json.loads(
        (config.checkpoint_dir / (config.checkpoint_dir / "LATEST").read_text() / "learner.json").read_text()
    )
    assert meta["handled"] == resumed.recent.to_list()


def test_a_metrics_line_lost_to_a_crash_is_written_on_resume(config, experience):
    learner = LearnerService(config)
    apply(learner, experience[0], 0)
    apply(learner, experience[1], 1)
    lines = learner.metrics_log.path.read_text().splitlines()
    learner.metrics_log.path.write_text(lines[0] + "\n")  # killed after the checkpoint, before the metrics line
    LearnerService(config)
    restored = learner.metrics_log.path.read_text().splitlines()
    assert restored == lines
    LearnerService(config)  # and only once
    assert learner.metrics_log.path.read_text().splitlines() == lines


def test_with_checkpoint_every_n_a_crash_re_applies_the_updates_since_the_checkpoint(config, experience, tmp_path):
    config = config.model_copy(update={"learner": config.learner.model_copy(update={"checkpoint_every": 3})})
    uninterrupted = LearnerService(
        config.model_copy(update={"run": config.run.model_copy(update={"dir": tmp_path / "a"})})
    )
    for offset, message in enumerate(experience):
        apply(uninterrupted, message, offset)

    first = LearnerService(config)
    assert [apply(first, experience[i], i)[1] for i in range(4)] == [False, False, True, False], (
        "input may be committed at every third update only"
    )
    del first  # killed: its fourth update was never checkpointed, and batch 3 never committed

    resumed = LearnerService(config)
    assert resumed.trainer.version == 3 and resumed.restored().offsets == {"experience/0": 3}
    assert len(resumed.metrics_log.path.read_text().splitlines()) == 3, "metrics lines only for checkpointed updates"
    apply(resumed, experience[3], 3)  # re-delivered from the committed offset, applied again
    assert resumed.make_durable(Progress({"experience/0": 4}), force=True), "shutdown checkpoints what is in hand"
    expected, actual = weights(uninterrupted), weights(resumed)
    assert all(torch.equal(expected[k], actual[k]) for k in expected), "same weights as a run that never stopped"


def test_experience_of_a_rolled_back_version_is_trained_off_policy_and_impossible_or_forged_batches_never_count(
    config, experience
):
    """Experience sampled by a version the learner's predecessor published after the last checkpoint is trained at
    once, corrected for as off-policy: held until that version is made again, it could wait for good (with groups
    taken as they arrive, the groups that made it need not all come again)."""
    config = config.model_copy(update={"learner": config.learner.model_copy(update={"checkpoint_every": 3})})
    learner = LearnerService(config)  # at v0; it may have announced up to v3 before a crash rolled it back

    def batch(step: int, version: int):
        return dataclasses.replace(sampled_by(experience[step if 0 <= step < 4 else 0], version), step=step)

    for impossible in (-1, config.steps_possible):  # the run's prompt batches and those that may replace stale ones
        assert learner.ready_for(batch(impossible, 0)), "let through, so that it does not block its partition"
        with pytest.raises(InputError, match=f"step {impossible} cannot be real"):
            learner.process(batch(impossible, 0))
    forged = batch(0, 1_000_000)  # the groups of the real step 0, a version no learner published
    assert learner.ready_for(forged), "let through: no learner can make that version"
    with pytest.raises(Dropped, match="newer than this learner"):
        learner.process(forged)
    assert learner.dropped_stale == 2 and learner.updates == 0 and not learner.done()

    rolled_back = batch(1, 3)  # step 1, sampled by the predecessor's v3
    prepared = learner.trainer._prepare(Experience.from_message(rolled_back))
    assert prepared.staleness.tolist() == [-3] * rolled_back.rows
    assert prepared.importance is not None, "π_old / π_behaviour corrects for the weights that sampled it"
    assert learner.ready_for(rolled_back) and len(learner.process(rolled_back)) == 2, "trained and announced at once"
    assert learner.unsaved_records[-1]["staleness_counts"] == {"-3": 2}
    assert len(learner.process(experience[0])) == 2, "the real groups of the forged keys are still applied"
    assert learner.updates == 2


def test_a_full_disk_fails_the_checkpoint_clearly_and_keeps_the_last_good_one(config, experience, small_disk):
    sized = LearnerService(config)
    apply(sized, experience[0], 0)
    one = sum(f.stat().st_size for f in config.checkpoint_dir.rglob("*") if f.is_file())
    disk = small_disk(int(one * 1.6) // 1024)  # room for one checkpoint, not for two
    config = config.model_copy(update={"learner": config.learner.model_copy(update={"checkpoint_dir": disk})})
    learner = LearnerService(config)
    apply(learner, experience[0], 0)
    with pytest.raises(NoSpaceError, match=rf"no space left on {disk} for checkpoint v2 \(needs [0-9.]+ MB"):
        apply(learner, experience[1], 1)
    assert (disk / "LATEST").read_text() == "ckpt-00000001" and not list(disk.glob(".*.tmp"))
    assert LearnerService(config).trainer.version == 1, "a restart resumes from the last good checkpoint"


def test_a_write_that_runs_out_of_space_is_explained_and_cleaned_up(small_disk):
    disk = small_disk(256)
    partial = disk / "snapshot.tmp"

    def write():
        with open(partial, "wb") as fh:
            fh.write(b"x" * (1 << 20))  # 1 MB on a 256 KB disk: ENOSPC from the kernel

    with pytest.raises(NoSpaceError, match="no space left on .* for a test file"):
        write_or_explain(disk, "a test file", 1, write, lambda: partial.unlink(missing_ok=True))
    assert not partial.exists()


def test_a_second_checkpoint_of_one_version_never_replaces_the_first_in_place(tmp_path):
    """Input consumed without an update (groups waiting, groups dropped) is checkpointed at the same version: the
    checkpoint LATEST points at must stay whole until its successor is in place."""
    from common.checkpoint import latest_checkpoint_version, load_latest_checkpoint, save_checkpoint

    def write(folder):
        (folder / "state").write_text("x")

    first = save_checkpoint(tmp_path, 3, write, 1, {"n": 1})
    second = save_checkpoint(tmp_path, 3, write, 1, {"n": 2})
    assert (first.name, second.name) == ("ckpt-00000003", "ckpt-00000003.0001") and first.exists()
    assert load_latest_checkpoint(tmp_path)[1] == {"n": 2} and latest_checkpoint_version(tmp_path) == 3
    third = save_checkpoint(tmp_path, 4, write, 1, {"n": 3})
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == [second.name, third.name], "the oldest pruned"
