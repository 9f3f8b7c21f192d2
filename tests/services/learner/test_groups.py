"""Groups as the unit past the generator: updates assembled from groups, dynamic sampling, admission in groups."""

import dataclasses
import json
import time
import zlib

import numpy as np
import pytest
import torch
from helpers import assert_each_group_once, experience_of_steps, publish, read_messages, sampled_by, started

from common.checkpoint import latest_checkpoint_version
from common.schema import LEARNER_GROUPS_DONE, ExperienceBatch, WeightAnnouncement, encode
from services.advantage import AdvantageService
from services.feeder import FeederService
from services.generator import GeneratorService
from services.launch.embedded import run_embedded
from services.learner import LearnerService
from services.roles import pipeline_topics
from services.scorer import ScorerService
from services.service import Progress
from services.transport import MemoryBus


@pytest.fixture
def config(make_config):
    # Batches of 2 prompts, updates of 3 groups (streaming: groups are sampled one by one): records and updates do
    # not line up. Staleness 3 lets every batch be sampled by v0.
    return make_config(
        "data.batch_size=2",
        "learner.groups_per_update=3",
        "generation.streaming=true",
        "generation.n=2",
        "generation.max_new_tokens=6",
        "learner.mini_batch_size=2",
        "pipeline.max_staleness=3",
        "data.eval_prompts=0",
    )


def apply(learner, message, offset):
    """What the runner does with one record: process it, then ask whether the state is durable."""
    outputs = learner.process(message)
    return outputs, learner.make_durable(Progress({"experience/0": offset + 1}, message.idempotency_keys()))


def actor_weights(learner):
    return {k: v.clone() for k, v in learner.trainer.state_dict()["actor"].items()}


def test_an_update_takes_its_count_of_groups_whatever_records_carry_them(config):
    experience = experience_of_steps(config, 3)
    learner = LearnerService(config)
    outputs, durable = apply(learner, experience[0], 0)
    assert outputs == [] and not durable, "two groups wait for a third; their record stays uncommitted"
    announced, durable = apply(learner, experience[1], 1)
    assert [a.policy_version for a in announced] == [1, 1] and durable
    assert announced[0].lineage[LEARNER_GROUPS_DONE] == 3
    assert [g.key for g in learner.buffer.groups] == ["1/1"], "the group left over waits for the next update"
    apply(learner, experience[2], 2)
    lines = [json.loads(line) for line in learner.metrics_log.path.read_text().splitlines()]
    assert [line["groups"] for line in lines] == [["0/0", "0/1", "1/0"], ["1/1", "2/0", "2/1"]]
    assert lines[1]["batch_ids"] == [experience[1].batch_id, experience[2].batch_id]
    assert [line["sequences"] for line in lines] == [6, 6]


def test_groups_waiting_for_an_update_are_in_the_checkpoint_and_a_crash_loses_none(config, tmp_path):
    experience = experience_of_steps(config, 3)
    uninterrupted = LearnerService(
        config.model_copy(update={"run": config.run.model_copy(update={"dir": tmp_path / "a"})})
    )
    for offset, message in enumerate(experience):
        apply(uninterrupted, message, offset)

    first = LearnerService(config)
    apply(first, experience[0], 0)
    assert apply(first, experience[1], 1)[1], "checkpointed with group 1/1 waiting"
    del first  # killed before record 2 arrived
    resumed = LearnerService(config)
    assert [g.key for g in resumed.buffer.groups] == ["1/1"] and resumed.restored().offsets == {"experience/0": 2}
    assert resumed.restored().handled == ["1/0", "1/1"], "the runner's memory: what the offsets cover"
    np.testing.assert_array_equal(
        resumed.buffer.groups[0].experience.response_tokens.numpy(),
        experience[1].response_tokens[experience[1].group_index == 1],
    )
    apply(resumed, experience[2], 2)
    expected, actual = actor_weights(uninterrupted), actor_weights(resumed)
    assert all(torch.equal(expected[k], actual[k]) for k in expected), "same weights as a run that never stopped"


def test_groups_that_waited_past_the_bound_are_dropped_and_announced_as_used_up(make_config):
    config = make_config(
        "data.batch_size=2", "generation.n=2", "generation.max_new_tokens=6", "learner.mini_batch_size=2"
    )  # max_staleness 0
    experience = experience_of_steps(config, 2)
    learner = LearnerService(config)
    (actor, _) = learner.process(experience[0])
    late = learner.process(experience[1])  # sampled by v0, the learner is at v1
    assert learner.updates == 1 and learner.dropped_stale == 2 and learner.groups_done == 4
    (progress,) = late
    assert progress.model == "actor" and progress.policy_version == 1 and progress.digest == actor.digest
    assert progress.lineage[LEARNER_GROUPS_DONE] == 4 and actor.lineage[LEARNER_GROUPS_DONE] == 2
    generator = GeneratorService(config)
    assert generator.on_weights(actor) and generator.on_weights(progress)
    assert generator.groups_done == 4 and generator.policy_version == 1
    feeder = FeederService(config)
    assert generator.ready_for(feeder.batch(2)) and not generator.ready_for(feeder.batch(3)), "admitted by groups"


def test_the_generator_admits_prompt_batches_by_groups_however_many_an_update_takes(make_config):
    config = make_config(
        "data.batch_size=2",
        "learner.groups_per_update=4",
        "generation.n=2",
        "generation.max_new_tokens=6",
        "learner.mini_batch_size=2",
    )  # max_staleness 0: one update's worth of groups ahead
    generator, feeder = GeneratorService(config), FeederService(config)
    assert generator.ready_for(feeder.batch(0)) and generator.ready_for(feeder.batch(1))
    assert not generator.ready_for(feeder.batch(2))
    assert "waits for the learner to have used up more than 0 groups" in generator.waiting_for(feeder.batch(2))


def scores_of(scored, scores):
    return dataclasses.replace(scored, scores=np.asarray(scores, dtype=np.float32))


def test_dynamic_sampling_drops_groups_whose_scores_are_all_equal_at_the_advantage_stage(make_config):
    overrides = (
        "data.batch_size=3",
        "generation.n=2",
        "generation.max_new_tokens=6",
        "learner.mini_batch_size=2",
    )
    plain = make_config(*overrides, example="grpo.yaml")
    dynamic = make_config(*overrides, "algorithm.dynamic_sampling=true", example="grpo.yaml")
    scored = ScorerService(plain).process(GeneratorService(plain).process(FeederService(plain).batch(0))[0])[0]
    scored = scores_of(scored, [1.0, 1.0, 0.0, 1.0, 0.5, 0.5])  # groups 0 and 2 are all equal
    (kept,) = AdvantageService(plain).process(scored)
    assert kept.groups() == [0, 1, 2] and kept.no_signal_groups.size == 0, "without dynamic sampling: all"
    (experience,) = AdvantageService(dynamic).process(scored)
    assert experience.groups() == [1] and experience.no_signal_groups.tolist() == [0, 2]
    np.testing.assert_array_equal(experience.advantages, kept.advantages[2:4])
    assert experience.idempotency_keys() == ["0/0", "0/1", "0/2"], "the record settles all three"
    (none,) = AdvantageService(dynamic).process(scores_of(scored, [1.0] * 6))
    assert none.rows == 0 and none.no_signal_groups.tolist() == [0, 1, 2], "an empty record still goes on"
    learner = LearnerService(dynamic)
    assert learner.process(none)[0].lineage[LEARNER_GROUPS_DONE] == 3, "used up without an update: announced"
    assert learner.no_signal == 3 and learner.updates == 0


def test_the_config_refuses_dynamic_sampling_without_a_group_estimator(make_config):
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="not a multiple of data.batch_size"):
        make_config("data.batch_size=4", "learner.groups_per_update=6", "learner.mini_batch_size=8")
    assert make_config("data.batch_size=4", "learner.groups_per_update=8", "learner.mini_batch_size=8")

    with pytest.raises(ConfigError, match="dynamic_sampling drops groups whose scores are all equal"):
        make_config("algorithm.dynamic_sampling=true")  # gae
    with pytest.raises(ConfigError, match="only algorithm.dynamic_sampling reads it"):
        make_config("algorithm.max_sampling_factor=2", example="grpo.yaml")
    config = make_config(
        "algorithm.dynamic_sampling=true", "algorithm.max_sampling_factor=2", "run.steps=5", example="grpo.yaml"
    )
    assert config.prompt_batches == 10  # 5 updates × 16 groups × 2, in batches of 16


SMALL = (
    "data.batch_size=2",
    "generation.n=4",
    "generation.max_new_tokens=6",
    "learner.mini_batch_size=4",
    "data.eval_prompts=0",
)


def test_an_embedded_run_whose_updates_span_records_trains_every_group_once(make_config):
    config = make_config(
        *SMALL, "run.steps=4", "learner.groups_per_update=3", "pipeline.max_staleness=1", "generation.streaming=true"
    )
    summary = run_embedded(config, progress=False)
    records = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").open()]
    assert summary.steps == 4 and all(len(r["groups"]) == 3 for r in records)
    assert_each_group_once(records, config.run.run_id, config.prompt_batches)  # 6 prompt batches of 2
    assert all(r["staleness_max"] <= 1 for r in records)


def half_the_prompts_teach_nothing(prompts, responses):
    """A prompt of even length scores 0 whatever the answer (its group has no signal); the others' answers score
    apart (a checksum of the text)."""
    return [zlib.crc32(r.encode()) % 1000 / 1000 if len(p) % 2 else 0.0 for p, r in zip(prompts, responses)]


def never_right(prompts, responses):
    return [0.0] * len(responses)


DYNAMIC = ("algorithm.dynamic_sampling=true",)


def test_dynamic_sampling_trains_full_updates_of_groups_with_signal_only(make_config):
    config = make_config(
        *SMALL,
        *DYNAMIC,
        "run.steps=3",
        f"reward.function={__name__}:half_the_prompts_teach_nothing",
        example="grpo.yaml",
    )
    bus = MemoryBus()
    summary = run_embedded(config, progress=False, bus=bus)
    records = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").open()]
    assert summary.steps == 3 and all(len(r["groups"]) == 2 for r in records), "every update has its full count"
    experience = [m for m in read_messages(bus, "experience") if isinstance(m, ExperienceBatch)]
    scores = {}
    for message in experience:
        for g in message.groups():
            scores[f"{message.step}/{g}"] = message.scores[message.group_index == g]
    trained = [key for r in records for key in r["groups"]]
    assert all(np.ptp(scores[key]) > 0 for key in trained), "no group whose scores are all equal was trained"
    dropped = sum(m.no_signal_groups.size for m in experience)
    assert dropped > 0 and summary.no_signal_groups == records[-1]["no_signal_groups"] > 0


def test_dynamic_sampling_that_uses_up_the_prompt_batches_ends_the_run_and_says_why(make_config, caplog):
    config = make_config(
        *SMALL,
        *DYNAMIC,
        "run.steps=2",
        "algorithm.max_sampling_factor=1.5",
        f"reward.function={__name__}:never_right",
        example="grpo.yaml",
    )
    summary = run_embedded(config, progress=False)
    assert summary.steps == 0 and summary.steps_planned == 2
    assert summary.ended_short.startswith(
        "the run ended after 0 of its 2 updates: all 3 prompt batches it may publish are used (6 groups had no signal"
    )
    assert "algorithm.max_sampling_factor=1.5" in summary.ended_short and "stale_reserve" not in summary.ended_short
    assert summary.done_line().startswith("ENDED SHORT: 0 of 2 steps (the run ended after 0 of its 2 updates")
    written = json.loads((config.run.dir / "summary.json").read_text())
    assert written["ended_short"] == summary.ended_short and written["steps_planned"] == 2


def test_streamppo_run_that_ends_short_exits_5_and_says_so(tmp_path, model_cache):
    from conftest import EXAMPLE
    from helpers import streamppo

    from services.runtime import exit_codes

    settings = [
        *SMALL,
        *DYNAMIC,
        "run.steps=2",
        "algorithm.max_sampling_factor=1.5",
        f"run.dir={tmp_path / 'run'}",
        f"model.cache_dir={model_cache}",
        "generation.backend=transformers",
        f"reward.function={__name__}:never_right",
    ]
    result = streamppo(
        "run", "--no-progress", "--config", EXAMPLE / "grpo.yaml", *(a for s in settings for a in ("--set", s))
    )
    assert result.returncode == exit_codes.RUN_SHORT == 5, result.stderr[-2000:]
    assert "ENDED SHORT: 0 of 2 steps" in result.stdout and "done:" not in result.stdout


def test_a_run_that_ends_short_of_its_steps_by_stale_groups_names_the_stale_reserve(make_config):
    """Groups dropped as too stale past what the reserve replaces: the cause is the reserve, not dynamic sampling."""
    learner = LearnerService(make_config(*SMALL, "run.steps=4", "pipeline.stale_reserve=0.5"))
    assert learner.shortfall() is not None and "no signal" not in learner.shortfall()
    learner.past_bound = learner.dropped_stale = 9  # the reserve: ceil(4 batches x 0.5) = 2 batches of 2 groups
    said = learner.shortfall()
    assert "9 groups were too stale to train, of which pipeline.stale_reserve=0.5 lets 4 be replaced" in said
    assert "raise pipeline.stale_reserve" in said and "max_sampling_factor" not in said
    learner.updates = 4
    assert learner.shortfall() is None


def test_announcements_of_the_version_loaded_bring_progress_without_reloading(make_config, monkeypatch):
    config = make_config("data.batch_size=2", "generation.n=2", "learner.mini_batch_size=2")
    learner = LearnerService(config)
    first = learner._progress_announcement()[0]  # v0: the snapshot of the initial weights is written once
    learner.groups_done = 2
    second = learner._progress_announcement()[0]
    assert (first.uri, first.digest) == (second.uri, second.digest) and second.lineage[LEARNER_GROUPS_DONE] == 2
    generator = GeneratorService(config)
    monkeypatch.setattr(generator.sampler, "load_snapshot", lambda chain: pytest.fail("the weights loaded are v0's"))
    assert generator.on_weights(first) and generator.on_weights(second) and generator.groups_done == 2
    assert isinstance(second, WeightAnnouncement)


OUT_OF_ORDER = (
    "data.batch_size=2",
    "generation.n=2",
    "generation.max_new_tokens=6",
    "learner.mini_batch_size=2",
    "pipeline.max_staleness=1",
    "data.eval_prompts=0",
)


def taken_out_of_order(config) -> list:
    """Steps 0 and 1 taken by v0, step 2 by v1 (max_staleness 1)."""
    experience = experience_of_steps(config, 3)
    experience[2] = sampled_by(experience[2], 1)
    return experience


def test_an_update_waits_for_a_group_in_flight_that_it_would_leave_past_the_bound(make_config):
    """Steps 0 and 1 are taken by v0 (max_staleness 1); step 1 comes first and makes v1; step 2, taken by v1, comes
    before step 0, still in flight: training on step 2 now would leave step 0 two versions behind, dropped for
    being slow. The update waits for it, and trains the oldest first."""
    config = make_config(*OUT_OF_ORDER)
    experience = taken_out_of_order(config)
    learner = LearnerService(config)
    assert learner.process(experience[1]) and learner.trainer.version == 1
    assert learner.process(experience[2]) == [] and learner.trainer.version == 1, "step 0 is in flight: wait"
    assert learner.staleness.waiting_since is not None
    (actor, _) = learner.process(experience[0])
    assert learner.trainer.version == 3 and learner.dropped_stale == 0, "both trained, none dropped"
    lines = learner.unsaved_records
    assert [line["groups"] for line in lines] == [["1/0", "1/1"], ["0/0", "0/1"], ["2/0", "2/1"]]
    assert [line["staleness_max"] for line in lines] == [0, 1, 1]


def test_a_group_that_never_comes_is_waited_for_only_hold_timeout_s(make_config):
    """The same wait, over the runner, for a group that never comes (dead-lettered on its way): after
    pipeline.hold_timeout_s with nothing to do, the runner's tick lets the update go on, checkpointed and announced."""
    config = make_config(*OUT_OF_ORDER, "pipeline.hold_timeout_s=0.3")
    experience = taken_out_of_order(config)
    bus = MemoryBus()
    bus.create_topics(pipeline_topics(partitions=1))
    publish(bus, "experience", encode(experience[1]), encode(experience[2]))  # step 0 never comes (dead-lettered)
    runner = started(LearnerService(config), bus)
    runner.poll_once(), runner.poll_once()
    assert runner.service.trainer.version == 1 and not runner.poll_once(), "waiting for step 0"
    time.sleep(0.4)
    assert runner.poll_once() and runner.service.trainer.version == 2, "the update went on without it"
    announced = [m for m in read_messages(bus, "weights") if m.policy_version == 2]
    assert {a.model for a in announced} == {"actor", "critic"}
    assert latest_checkpoint_version(config.checkpoint_dir) == 2, "checkpointed before it was announced"


def test_a_relabelled_record_of_a_later_step_is_dead_lettered_and_never_moves_the_bound(make_config):
    """An outside audit's forgery: another run's record relabelled with this run's id and a later step. Dropped as
    stale, it counted its groups as used up, which moved the staleness bound for good (a run ended at 24 of its 40
    updates). Its version cannot have sampled that step (no announcement let a generator take it): it is set aside
    with why, and the groups used up are only the real ones."""
    config = make_config(
        "data.batch_size=2", "generation.n=2", "learner.mini_batch_size=4", "pipeline.max_staleness=0",
        "run.steps=12", "data.eval_prompts=0",
    )  # fmt: skip
    bus = MemoryBus()
    bus.create_topics(pipeline_topics())
    learner = LearnerService(config)
    runner = started(learner, bus)
    (real,) = experience_of_steps(config, 1)
    forged = dataclasses.replace(real, step=11, batch_id=f"{config.run.run_id}-00000011")  # sampled by v0
    publish(bus, "experience", encode(real), encode(forged))
    runner.poll_once(), runner.poll_once()
    assert learner.updates == 1 and learner.groups_done == 2, "the real batch trained; the forgery used up nothing"
    (letter,) = read_messages(bus, "experience.dlq")
    assert "group 11/0 cannot have been sampled by v0" in letter.error
    assert learner.dropped_stale == 0 and runner.counters["dead_letters"] == 1


def test_groups_dropped_as_too_stale_are_replaced_and_the_run_makes_all_its_updates(make_config):
    """Groups that waited past max_staleness (an agent's long episode, a learner rolled back by a crash) are dropped,
    and the run once ended short by as many (13 of 16 updates). The learner's announcement now asks for replacements
    (learner.replacements, within pipeline.stale_reserve); the feeder publishes the next prompts as a batch past the
    run's own; the learner takes it and makes every update."""
    from common.schema import LEARNER_REPLACEMENTS

    config = make_config(
        "data.batch_size=2", "generation.n=2", "learner.mini_batch_size=4", "pipeline.max_staleness=0",
        "run.steps=2", "data.eval_prompts=0",
    )  # fmt: skip
    assert (config.prompt_batches, config.replacement_batches) == (2, 1)
    learner, feeder = LearnerService(config), FeederService(config)
    first, second = experience_of_steps(config, 2)
    learner.process(first)  # update 1: the learner is at v1
    (announcement,) = [a for a in learner.process(second) if a.model == "actor"]  # sampled by v0: too stale now
    assert learner.dropped_stale == 2 and learner.updates == 1
    assert announcement.lineage[LEARNER_REPLACEMENTS] == 1 and not learner.done()
    feeder.start()
    feeder.on_weights(announcement)
    (replacement,) = feeder.tick()
    assert replacement.step == 2 and feeder.tick() == [] and not feeder.done()
    groups = GeneratorService(config).process(replacement)
    scored = ScorerService(config).process(groups[0])
    (experience,) = AdvantageService(config).process(sampled_by(scored[0], 1))
    learner.process(experience)
    assert learner.updates == 2 and learner.done(), "every update made, of the replacement's groups"
