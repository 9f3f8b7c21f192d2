"""Delivery rules over a real broker started by the tests: dead letters, refused announcements, groups across
partitions, forged experience, batches that can never be sampled, a replaced learner."""

import json
import time
import uuid

import pytest
import torch
from helpers import (
    experience_of_steps,
    sampled_by,
    started_replica,
)
from processes import unique

from common.schema import DeadLetter, SchemaError, decode
from services.runtime.run_bus import kafka_bus

pytestmark = pytest.mark.slow  # services as processes and a broker per test where it needs one


def test_a_malformed_record_lands_in_the_dlq_over_kafka(bus, kafka_config):
    from services.scorer import ScorerService

    serving = started_replica(ScorerService(kafka_config, unique("scorer")), bus)
    runner = serving.runner
    marker = uuid.uuid4().bytes
    producer = bus.producer("test")
    producer.send("rollouts", b"\xc1not msgpack" + marker)
    producer.flush()
    dlq = bus.consumer("rollouts.dlq", None, "reader")
    letters, deadline = [], time.monotonic() + 60
    while not letters and time.monotonic() < deadline:
        runner.poll_once(timeout_s=0.5)
        letters = [decode(r.value) for r in dlq.poll(0.1, max_records=100)]
        letters = [letter for letter in letters if letter.payload.endswith(marker)]
    assert letters and isinstance(letters[0], DeadLetter) and letters[0].source_topic == "rollouts"
    serving.stop(finished=False)


def test_a_refused_weight_announcement_does_not_block_the_real_one(make_config, kafka_broker):
    """A forged announcement of the next version (its file missing) must not make the real one look old."""
    import dataclasses

    from common.schema import encode, message_key
    from services.advantage import AdvantageService
    from services.learner import LearnerService

    config = make_config(*kafka_broker, f"run.run_id={unique('refused')}")
    bus = kafka_bus(config)
    learner = LearnerService(config)

    def announce(version):
        with torch.no_grad():
            for p in learner.trainer.critic.parameters():
                p.add_(0.01)
        learner.trainer.version = version
        announcements = learner.announce()
        producer = bus.producer("test")
        for announcement in announcements:
            producer.send("weights", encode(announcement), key=message_key(announcement))
        producer.flush()
        return [a for a in announcements if a.model == "critic"][0]

    real_v1 = announce(1)
    missing = real_v1.uri + ".missing"
    forged_v2 = dataclasses.replace(real_v1, policy_version=2, uri=missing, chain=[f"{real_v1.digest} {missing}"])
    producer = bus.producer("test")
    producer.send("weights", encode(forged_v2), key=message_key(forged_v2))
    producer.flush()

    advantage = AdvantageService(config, unique("advantage"))
    serving = started_replica(advantage, bus)
    runner = serving.runner

    def poll_until(version):
        deadline = time.monotonic() + 30
        while advantage.critic_version < version and time.monotonic() < deadline:
            runner.poll_once(0.2)

    poll_until(1)
    assert advantage.critic_version == 1 and runner.counters["refused_weights"] == 1, "v2 refused, v1 taken"
    announce(2)  # the learner's real v2
    poll_until(2)
    assert advantage.critic_version == 2, "the real v2 is loaded although a v2 was refused before"
    serving.stop(finished=False)


# A run whose batches are quick to make in-process: two prompts, two samples each, staleness up to 1.
SMALL_RUN = (
    "pipeline.max_staleness=1",
    "data.batch_size=2",
    "generation.n=2",
    "generation.max_new_tokens=6",
    "learner.mini_batch_size=4",
    "data.eval_prompts=0",
)


def keys_for_partitions(count: int, partitions: int) -> list[bytes]:
    """One message key per partition 0..count-1, as kafka-python's default partitioner places keys."""
    from kafka.partitioner.default import murmur2

    keys: dict[int, bytes] = {}
    for candidate in (f"k{i}".encode() for i in range(10_000)):
        keys.setdefault((murmur2(candidate) & 0x7FFFFFFF) % partitions, candidate)
        if len(keys) == partitions:
            break
    return [keys[p] for p in range(count)]


def test_the_learner_trains_groups_as_they_arrive_across_partitions_within_the_staleness_bound(
    make_config, kafka_broker
):
    """Partitions deliver out of order. Groups are trained as they arrive, but never by a learner older than the
    policy that sampled them, nor more than max_staleness versions newer: what the bound passes is dropped."""

    from common.schema import encode
    from services.learner import LearnerService

    config = make_config(*kafka_broker, f"run.run_id={unique('order')}", *SMALL_RUN)
    batches = experience_of_steps(config, 3)
    batches[2] = sampled_by(batches[2], 1)  # step 2 is sampled once v1 is out (k = 1)
    # Keys that put the three steps on three different partitions, the last step first in time.
    keys = keys_for_partitions(3, config.kafka.partitions)
    bus = kafka_bus(config)
    producer = bus.producer("test")
    for step in (2, 1, 0):
        producer.send("experience", encode(batches[step]), key=keys[step])
    producer.flush()

    learner = LearnerService(config, unique("learner"))
    serving = started_replica(learner, bus)
    runner = serving.runner
    deadline = time.monotonic() + 60
    while learner.groups_done < 6 and time.monotonic() < deadline:
        runner.poll_once(0.2)
    serving.stop(finished=False)
    lines = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").read_text().splitlines()]
    trained = [key for line in lines for key in line["groups"]]
    assert len(trained) == len(set(trained)) == 2 * learner.updates, "each group once, two per update"
    assert len(trained) + learner.dropped_stale == 6, "every group trained or dropped"
    assert "2/0" not in lines[0]["groups"], "v1's groups wait for the learner to reach v1"
    assert all(line["staleness_max"] <= 1 for line in lines), "none trained past the bound"


def test_forged_and_replayed_experience_neither_takes_a_real_batch_s_place_nor_counts_as_an_update(
    make_config, kafka_broker
):
    """Case 2 of the operations issue, over the broker: a record claiming policy v1,000,000 under the keys of
    step 0, a replay of an applied batch and a step no run has, each ahead of the real batches in their partitions.
    The run applies exactly its three real batches and ends."""
    import dataclasses

    from common.schema import encode
    from services.learner import LearnerService

    config = make_config(
        *kafka_broker, f"run.run_id={unique('forged')}", "run.steps=3", *SMALL_RUN, "pipeline.max_staleness=2"
    )
    real = experience_of_steps(config, 3)
    real[2] = sampled_by(real[2], 1)
    a, b, c = keys_for_partitions(3, config.kafka.partitions)
    in_order = [
        (a, sampled_by(real[0], 1_000_000)),  # from a policy no learner published
        (a, real[0]),
        (b, real[2]),
        (c, real[1]),
        (c, real[0]),  # a replay of a batch already applied
        (c, dataclasses.replace(real[1], step=1_000_000, batch_id=unique("forged"))),  # a step no run can have
    ]
    bus = kafka_bus(config)
    producer = bus.producer("test")
    for key, message in in_order:
        producer.send("experience", encode(message), key=key)
    producer.flush()

    learner = LearnerService(config, unique("learner"))
    serving = started_replica(learner, bus)
    runner = serving.runner
    outcomes = ("processed", "dead_letters", "duplicates", "dropped")
    deadline = time.monotonic() + 60
    while not (learner.done() and sum(runner.counters[o] for o in outcomes) == len(in_order)):
        assert time.monotonic() < deadline, f"not every record handled: {dict(runner.counters)}"
        runner.poll_once(0.2)
    serving.stop(finished=False)
    lines = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").read_text().splitlines()]
    trained = sorted(key for line in lines for key in line["groups"])
    assert trained == sorted(k for m in real for k in m.idempotency_keys()), "the real groups, each once"
    assert [line["step"] for line in lines] == [1, 2, 3] and learner.updates == 3, "updates count applied batches"
    assert runner.counters["dead_letters"] == 1 and runner.counters["processed"] == 3
    # The partitions are read in no set order: the forgery, under step 0's batch id, is either dropped as stale
    # (read before step 0's batch: two groups) or recognised as that batch again (read after it), as the replay is.
    assert runner.counters["duplicates"] + runner.counters["dropped"] == 2, "the forgery and the replay: neither"
    assert learner.dropped_stale == 2 * runner.counters["dropped"], "a forgery dropped drops its two groups"


def test_prompt_batches_that_can_never_be_sampled_do_not_block_their_partitions(make_config, kafka_broker):
    """Case 3 of the operations issue, over the broker: a far-future prompt batch at the head of every partition,
    and one of a later step of the run ahead of the real first batch, which waits for weights that never come. The
    first go to the dead-letter topic at once; the real batch is sampled at once, read past the one kept aside, which
    goes to the dead-letter topic once the hold bound has passed with nothing to do."""
    from common.schema import encode
    from services.feeder import FeederService
    from services.generator import GeneratorService

    config = make_config(
        *kafka_broker,
        f"run.run_id={unique('future')}",
        "run.steps=3",
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "learner.mini_batch_size=4",
        "pipeline.hold_timeout_s=2",
    )
    feeder = FeederService(config)
    keys = keys_for_partitions(config.kafka.partitions, config.kafka.partitions)
    producer = kafka_bus(config).producer("test")
    for key in keys:
        forged = feeder.batch(0)
        forged.step, forged.batch_id = 10**9, unique("forged")  # (with the real id, read after it: a duplicate)
        producer.send("prompts", encode(forged), key=key)
    ahead = feeder.batch(2)
    ahead.batch_id = unique("forged")
    producer.send("prompts", encode(ahead), key=keys[0])  # waits for the learner's progress, which never comes
    producer.send("prompts", encode(feeder.batch(0)), key=keys[0])  # the real first batch, behind both
    producer.flush()

    generator = GeneratorService(config, unique("generator"))
    bus = kafka_bus(config)
    serving = started_replica(generator, bus)
    runner = serving.runner
    rollouts = bus.consumer("rollouts", None, unique("audit"))
    sampled, deadline = [], time.monotonic() + 60
    while not sampled and time.monotonic() < deadline:
        runner.poll_once(0.2)
        for record in rollouts.poll(0.0, 100):
            try:
                message = decode(record.value)
            except SchemaError:
                continue  # other tests put garbage on the shared topics
            if message.lineage.get("run.id") == config.run.run_id:
                sampled.append(message.step)
    letters = []
    dlq, deadline = bus.consumer("prompts.dlq", None, unique("audit")), time.monotonic() + 30
    while len(letters) < len(keys) + 1 and time.monotonic() < deadline:
        runner.poll_once(0.2)
        for record in dlq.poll(0.5, 100):
            letter = decode(record.value, DeadLetter)
            # This generator also dead-letters what other tests left on the shared topic (garbage bytes).
            ours = "outside the run" in letter.error or "held" in letter.error
            if letter.producer == generator.replica_id and ours:
                letters.append(letter.error)
    serving.stop(finished=False)
    assert sampled == [0], "the real first batch was sampled"
    assert sum("outside the run" in e for e in letters) == len(keys), letters
    assert sum("waits for the learner to have used up more than 2 groups" in e for e in letters) == 1, letters
    assert len(letters) == len(keys) + 1 and not runner.held


def test_announcements_of_a_replaced_learner_are_ignored_and_a_newer_epoch_rolls_versions_back(
    make_config, kafka_broker
):
    """A learner restarted elsewhere takes a new epoch; the old one (a zombie) may go on announcing. A learner that
    restarts from an older checkpoint announces a lower version: its weights replace the rolled-back ones."""
    from common.schema import encode, message_key
    from services.advantage import AdvantageService
    from services.learner import LearnerService

    config = make_config(*kafka_broker, f"run.run_id={unique('zombie')}", "data.eval_prompts=0")
    bus = kafka_bus(config)
    zombie, successor = LearnerService(config, "learner-old"), LearnerService(config, "learner-new")
    zombie.start(), successor.start()
    assert (zombie.epoch, successor.epoch) == (1, 2)

    def announce(learner, version):
        learner.trainer.version = version
        producer = bus.producer("test")
        for announcement in learner.announce():
            producer.send("weights", encode(announcement), key=message_key(announcement))
        producer.flush()

    advantage = AdvantageService(config, unique("advantage"))
    serving = started_replica(advantage, bus)
    runner = serving.runner

    def poll(until):
        deadline = time.monotonic() + 30
        while not until() and time.monotonic() < deadline:
            runner.poll_once(0.2)

    announce(successor, 2)
    poll(lambda: advantage.critic_version == 2)
    announce(zombie, 3)  # a higher version, from the replaced learner
    poll(lambda: runner.counters["zombie_announcements"] > 0)
    assert advantage.critic_version == 2 and runner.counters["zombie_announcements"] == 1
    announce(successor, 4)
    poll(lambda: advantage.critic_version == 4)
    assert advantage.critic_version == 4
    restarted = LearnerService(config, "learner-restarted")  # back from a checkpoint at v3: v4 is rolled back
    restarted.start()
    announce(restarted, 3)
    poll(lambda: advantage.critic_version == 3)
    assert advantage.critic_version == 3 and runner.counters["zombie_announcements"] == 1
    announce(successor, 5)  # the replaced learner of epoch 2 again
    poll(lambda: runner.counters["zombie_announcements"] > 1)
    assert advantage.critic_version == 3
    serving.stop(finished=False)
