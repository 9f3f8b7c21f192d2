"""The streaming generator: prompt batches admitted as room frees up, groups sent on as they are sampled, each by the
weights loaded at that moment; an input committed only once its last group is out."""

import json

import pytest
from helpers import announce_v1, assert_each_group_once, publish, read_messages, started

from common.schema import RolloutBatch, encode
from services.feeder import FeederService
from services.generator import GeneratorService
from services.launch.embedded import run_embedded
from services.scorer import ScorerService
from services.transport import MemoryBus


@pytest.fixture
def config(make_config):
    return make_config(
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "learner.mini_batch_size=4",
        "generation.streaming=true",
        "pipeline.max_staleness=1",
    )


@pytest.fixture
def bus():
    from services.roles import pipeline_topics

    bus = MemoryBus()
    bus.create_topics(pipeline_topics(partitions=1))
    return bus


def rollouts(bus) -> list[RolloutBatch]:
    return [m for m in read_messages(bus, "rollouts") if isinstance(m, RolloutBatch)]


def test_a_generator_that_lost_its_log_drops_its_groups_in_flight_and_samples_them_again_on_the_new_one(config):
    """The broker lost the log mid-batch: the group sent on the old log is gone with it, the one in flight is dropped
    (never sent anywhere), and the prompt batch published again on the new log is sampled whole, once, by the same
    service (its model kept)."""
    from services.roles import pipeline_topics

    old, new = MemoryBus(), MemoryBus()
    for log in (old, new):
        log.create_topics(pipeline_topics(partitions=1))
    generator, feeder = GeneratorService(config, "generator"), FeederService(config)
    runner = started(generator, old)
    publish(old, "prompts", encode(feeder.batch(0)))
    assert runner.poll_once() and runner.poll_once()  # admits batch 0, sends group 0
    assert [r.groups() for r in rollouts(old)] == [[0]] and generator.under_way(), "group 1 is in flight"
    runner.release_lost_log()
    assert generator.take_up_new_log()
    assert not generator.under_way() and generator.sampler.in_flight() == 0, "nothing of the old log is in flight"
    runner = started(generator, new)
    publish(new, "prompts", encode(feeder.batch(0)))
    while runner.poll_once():
        pass
    assert [r.groups() for r in rollouts(new)] == [[0], [1]], "the batch sampled whole, each group once"
    assert [r.groups() for r in rollouts(old)] == [[0]], "nothing more went to the lost log"


def test_each_group_goes_on_as_it_is_sampled_by_the_weights_loaded_then(bus, config):
    runner = started(GeneratorService(config, "generator"), bus)
    feeder = FeederService(config)
    publish(bus, "prompts", encode(feeder.batch(0)), encode(feeder.batch(1)))
    assert runner.poll_once()  # admits batch 0
    assert runner.poll_once() and [r.groups() for r in rollouts(bus)] == [[0]], "group 0 went on alone"
    assert feeder.batch(0).batch_id in runner.streaming.in_flight, "batch 0 is not done: not committed"
    publish(bus, "weights", *[encode(a) for a in announce_v1(config)])
    while runner.poll_once():
        pass
    sent = rollouts(bus)
    assert [(r.step, r.groups(), r.policy_version) for r in sent] == [
        (0, [0], 0),
        (0, [1], 1),
        (1, [0], 1),
        (1, [1], 1),
    ]
    assert sent[1].batch_id == f"{feeder.batch(0).batch_id}/1-1", "a record's id names its prompt batch and rows"
    assert not runner.streaming.in_flight and runner.counters["processed"] == 2


class _PollTimeouts:
    """A consumer that records the timeout of each poll."""

    def __init__(self, consumer):
        self.consumer, self.timeouts = consumer, []

    def poll(self, timeout_s: float = 0.0, max_records: int = 1):
        self.timeouts.append(timeout_s)
        return self.consumer.poll(timeout_s, max_records)

    def __getattr__(self, name):
        return getattr(self.consumer, name)


def test_a_batch_held_for_newer_weights_does_not_idle_the_groups_in_hand(bus, config):
    """With a prompt batch held (max_staleness 0: batch 1 waits for v1), the runner does not wait on the weights
    topic while groups of batch 0 are still being sampled (it did: half a second between engine steps, a streaming
    run's updates 13 times slower over the broker); once batch 0 is out and nothing else can move, it waits there."""
    config = config.model_copy(update={"pipeline": config.pipeline.model_copy(update={"max_staleness": 0})})
    runner = started(GeneratorService(config, "generator"), bus)
    runner.weights.consumer = weights = _PollTimeouts(runner.weights.consumer)
    feeder = FeederService(config)
    publish(bus, "prompts", encode(feeder.batch(0)), encode(feeder.batch(1)))
    for _ in range(10):  # admits batch 0, starts its groups, reads batch 1
        if runner.held:
            break
        runner.poll_once(0.2)
    assert [held.message.step for held in runner.held] == [1], "batch 1 waits for the learner"
    waited = []
    while runner.service.under_way():
        weights.timeouts.clear()
        runner.poll_once(0.2)
        waited += weights.timeouts
    assert waited and set(waited) == {0.0}, f"the weights topic was waited on with groups in hand: {waited}"
    assert sorted(g for r in rollouts(bus) for g in r.groups()) == [0, 1], "batch 0 sampled whole"
    weights.timeouts.clear()
    runner.poll_once(0.2)
    assert weights.timeouts == [0.2], "with nothing else to do, the runner waits for the weights that batch 1 needs"


def test_groups_start_in_feed_order_whatever_order_their_prompt_batches_came_in(make_config):
    """A restarted generator gets its prompt batches from several partitions in any order: here batch 1 before batch
    0. The learner has used up 1 group (updates of 1, max_staleness 1), so the groups at feed positions 0, 1 and 2 may
    be sampled and position 3 (batch 1's row 1) may not yet. Batch 0's groups, which the learner needs next, start:
    queued behind batch 1's second group they waited for it, and it for them (the chaos test's stall)."""
    from services.roles import pipeline_topics

    config = make_config(
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "learner.mini_batch_size=2",
        "learner.groups_per_update=1",
        "generation.streaming=true",
        "pipeline.max_staleness=1",
    )
    bus = MemoryBus()
    bus.create_topics(pipeline_topics(partitions=2))
    publish(bus, "weights", *[encode(a) for a in announce_v1(config, version=1)])
    feeder = FeederService(config)
    publish(bus, "prompts", encode(feeder.batch(1)), partition=0)  # read first
    publish(bus, "prompts", encode(feeder.batch(0)), partition=1)
    runner = started(GeneratorService(config, "generator"), bus)
    for _ in range(40):
        runner.poll_once(0.05)
        if len({g for r in rollouts(bus) for g in r.idempotency_keys()}) == 3:
            break
    sent = sorted(g for r in rollouts(bus) for g in r.idempotency_keys())
    assert sent == ["0/0", "0/1", "1/0"], "every group the bound allows, batch 0's first"
    assert runner.waiting_for() == "waiting for input" and runner.service.queue, "batch 1's row 1 waits for the bound"


def test_a_prompt_batch_half_sent_by_a_generator_that_died_is_sampled_again_and_its_sent_groups_recognised(bus, config):
    feeder = FeederService(config)
    publish(bus, "prompts", encode(feeder.batch(0)))
    first = started(GeneratorService(config, "generator-a"), bus)
    first.poll_once(), first.poll_once()  # admitted, group 0 sent
    first.work.close()  # killed: batch 0 was never committed
    successor = started(GeneratorService(config, "generator-b"), bus)
    while successor.poll_once():
        pass
    sent = rollouts(bus)
    assert [(r.producer, r.groups()) for r in sent] == [
        ("generator-a", [0]),
        ("generator-b", [0]),
        ("generator-b", [1]),
    ]
    scorer = started(ScorerService(config, "scorer"), bus)
    while scorer.poll_once():
        pass
    scored = read_messages(bus, "scored")
    assert sorted(g for m in scored for g in m.idempotency_keys()) == ["0/0", "0/1"], "each group scored once"
    assert scorer.counters["duplicates"] == 1 and scorer.counters["processed"] == 2


def test_a_streaming_run_trains_every_group_once_some_sampled_across_an_update(config):
    bus = MemoryBus()
    config = config.model_copy(update={"run": config.run.model_copy(update={"steps": 4})})
    run_embedded(config, progress=False, bus=bus)
    records = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").open()]
    assert_each_group_once(records, config.run.run_id, 4)
    assert all(r["staleness_max"] <= 1 for r in records)
    versions = {}
    for r in rollouts(bus):
        versions.setdefault(r.step, set()).add(r.policy_version)
    assert any(len(v) > 1 for v in versions.values()), f"an update landed mid prompt batch: {versions}"


def collect_all(generator, records: int) -> list:
    out = []
    while len(out) < records:
        out += generator.collect()
    return out


@pytest.mark.parametrize("setting", ["groups_per_record=2", "flush_s=2", "in_flight_updates=keep"])
def test_the_streaming_settings_are_for_streaming_only(make_config, setting):
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="only generation.streaming reads it"):
        make_config(f"generation.{setting}")


def test_finished_groups_share_a_record_up_to_groups_per_record_or_until_flush_s(make_config):
    settings = ("generation.streaming=true", "data.batch_size=4", "learner.mini_batch_size=8")
    feeder = FeederService(make_config(*settings))
    by_count = GeneratorService(make_config(*settings, "generation.groups_per_record=3", "generation.flush_s=600"))
    by_count.admit(feeder.batch(0))
    first, second = collect_all(by_count, 2)
    assert first.outputs[0].groups() == [0, 1, 2] and not first.done
    assert second.outputs[0].groups() == [3] and second.done, "the rest of the batch goes at once"
    assert by_count.collect() == []
    by_time = GeneratorService(make_config(*settings, "generation.groups_per_record=3", "generation.flush_s=0.001"))
    by_time.admit(feeder.batch(0))
    (early,) = collect_all(by_time, 1)  # one group sampled per collect here (transformers: group by group)
    assert len(early.outputs[0].groups()) < 3 and not early.done, "a group that waited flush_s goes with what is ready"


def test_the_simulated_engine_decodes_each_sequence_for_its_own_length_and_not_while_weights_load():
    """The streaming benchmark's engine (benchmarks/cluster/simulated.py): what its numbers rest on."""
    import numpy as np

    from benchmarks.cluster.simulated import ContinuousBatching

    clock = [0.0]
    engine = ContinuousBatching(slots=2, step_s=1.0, now=lambda: clock[0])
    engine.add("a", np.array([3, 5]))
    engine.add("b", np.array([2]))  # waits for a slot
    clock[0] = 3.0
    assert engine.advance() == [] and engine.active == [["a", 2], ["b", 2]], "a's short answer freed a slot for b"
    clock[0] = 5.0
    assert sorted(engine.advance()) == ["a", "b"] and not engine.active
    engine.add("c", np.array([4]))
    engine.pause(10.0)  # weights loading: no token decoded meanwhile
    clock[0] = 15.0
    assert engine.advance() == [] and engine.active == [["c", 4]]
    clock[0] = 19.5
    assert engine.advance() == ["c"]
