"""Delivery rules of every service: dead letters, de-duplication, commit after produce, bounded staleness."""

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import announce_v1, publish, read_all, sampled_by, started, started_replica
from safetensors import safe_open

from common.batch_store import BatchStore
from common.schema import BatchReference, DeadLetter, RolloutBatch, decode, encode
from services.feeder import FeederService
from services.generator import GeneratorService
from services.learner import LearnerService
from services.roles import pipeline_topics
from services.scorer import ScorerService
from services.transport import MemoryBus


@pytest.fixture
def bus():
    bus = MemoryBus()
    bus.create_topics(pipeline_topics(partitions=2))
    return bus


@pytest.fixture
def config(make_config):
    return make_config(
        "data.batch_size=2", "generation.n=2", "generation.max_new_tokens=4", "learner.mini_batch_size=4"
    )


@pytest.mark.parametrize("topic", ["prompts", "rollouts", "scored", "experience"])
def test_malformed_input_goes_to_the_dlq_and_the_service_keeps_going(bus, config, topic):

    service = consumer_of(topic)(config, f"{topic}-consumer")
    runner = started(service, bus)
    upstream = _valid_input(bus, config, topic)
    publish(bus, topic, b"\x93garbage", upstream)
    assert runner.poll_once() and runner.poll_once()
    letters = [decode(v) for v in read_all(bus, f"{topic}.dlq")]
    assert len(letters) == 1 and isinstance(letters[0], DeadLetter)
    assert letters[0].payload == b"\x93garbage" and letters[0].source_topic == topic
    assert letters[0].source_offset == 0 and "msgpack" in letters[0].error
    assert runner.counters["processed"] == 1 and runner.counters["dead_letters"] == 1
    assert len(read_all(bus, service.output_topic)) == (2 if topic == "experience" else 1)


def consumer_of(topic: str) -> type:
    """The service class whose replicas read ``topic``."""
    from services.advantage import AdvantageService

    return {
        "prompts": GeneratorService,
        "rollouts": ScorerService,
        "scored": AdvantageService,
        "experience": LearnerService,
    }[topic]


def _valid_input(bus, config, topic) -> bytes:
    """Run the real upstream services to get one valid message for ``topic``."""
    from services.advantage import AdvantageService

    message = FeederService(config).batch(0)
    for upstream, stage in (("prompts", GeneratorService), ("rollouts", ScorerService), ("scored", AdvantageService)):
        if upstream == topic:
            break
        message = stage(config).process(message)[0]
    return encode(message)


def test_an_output_that_cannot_be_encoded_sets_its_input_aside_and_the_replica_goes_on(bus, config):
    """No record may crash-loop a replica: an output the schema refuses (here a score no float32 holds, as a reward
    of 1e39 once was) is sent nowhere, its input is dead-lettered with why, and the next input is served."""

    class Overflowing(ScorerService):
        def process(self, message):
            outputs = super().process(message)
            if message.step == 0:
                outputs[0].scores[:] = np.float32(np.inf)
            return outputs

    scorer = started_replica(Overflowing(config, "scorer"), bus)
    runner = scorer.runner
    generator = GeneratorService(config)
    feeder = FeederService(config)
    for step in (0, 1):
        publish(bus, "rollouts", encode(generator.process(feeder.batch(step))[0]))
    assert runner.poll_once() and runner.poll_once()
    (letter,) = [decode(v) for v in read_all(bus, "rollouts.dlq")]
    assert "cannot be encoded" in letter.error and "NaN or infinity" in letter.error and letter.source_offset == 0
    (scored,) = [decode(v) for v in read_all(bus, "scored")]
    assert scored.step == 1 and runner.counters["dead_letters"] == 1 and runner.counters["processed"] == 1
    scorer.stop(finished=False)  # both were committed past: a successor in the group reads neither again
    successor = started(ScorerService(config, "scorer-2"), bus)
    assert not successor.poll_once(0.1) and read_all(bus, "scored") == [encode(scored)]


def test_a_message_for_another_topic_is_a_dead_letter(bus, config):
    runner = started(ScorerService(config, "scorer"), bus)
    publish(bus, "rollouts", encode(FeederService(config).batch(0)))  # a prompts message on the rollouts topic
    runner.poll_once()
    (letter,) = [decode(v) for v in read_all(bus, "rollouts.dlq")]
    assert "expected a 'rollouts' or 'batch_reference' message, got 'prompts'" in letter.error


def test_token_ids_outside_the_vocabulary_are_dead_letters(bus, config):
    runner = started(GeneratorService(config, "generator"), bus)
    batch = FeederService(config).batch(0)
    batch.prompt_tokens[0, 0] = 10_000
    publish(bus, "prompts", encode(batch))
    assert runner.poll_once()
    (letter,) = [decode(v) for v in read_all(bus, "prompts.dlq")]
    assert "outside the actor's vocabulary" in letter.error
    assert read_all(bus, "rollouts") == []


def test_a_redelivered_batch_is_processed_once(bus, config):
    runner = started(GeneratorService(config, "generator"), bus)
    payload = encode(FeederService(config).batch(0))
    publish(bus, "prompts", payload, payload)
    runner.poll_once(), runner.poll_once()
    assert len(read_all(bus, "rollouts")) == 1
    assert runner.counters["duplicates"] == 1


def test_input_is_committed_only_after_the_output_is_produced(bus, config):
    class Exploding(GeneratorService):
        def process(self, message):
            raise RuntimeError("killed mid-batch")

    publish(bus, "prompts", encode(FeederService(config).batch(0)))
    crashing = started_replica(Exploding(config, "generator-a"), bus)
    with pytest.raises(RuntimeError):
        crashing.step()
    crashing.stop(finished=False)  # the replica dies; its uncommitted input goes to the next one
    survivor = started(GeneratorService(config, "generator-b"), bus)
    assert survivor.poll_once()
    (rollouts,) = [decode(v) for v in read_all(bus, "rollouts")]
    assert isinstance(rollouts, RolloutBatch) and rollouts.batch_id.endswith("00000000")


def test_outputs_that_failed_to_go_out_are_sent_again_before_anything_else_and_only_then_committed(bus, config):
    """A broker error while sending (a fault the in-memory bus cannot have: injected) loses no output and processes
    nothing twice: the same outputs are sent again, then the input is committed."""
    from kafka.errors import KafkaTimeoutError

    class FailingOnce:
        def __init__(self, producer):
            self.producer, self.failed = producer, False

        def send(self, topic, value, key=None, partition=None):
            if topic == "rollouts" and not self.failed:
                self.failed = True
                raise KafkaTimeoutError("the broker did not answer")
            self.producer.send(topic, value, key, partition)

        def __getattr__(self, name):
            return getattr(self.producer, name)

    feeder = FeederService(config)
    publish(bus, "prompts", encode(feeder.batch(0)), encode(feeder.batch(1)))
    generator = started_replica(GeneratorService(config, "generator"), bus)
    runner = generator.runner
    runner.sender.producer = FailingOnce(runner.sender.producer)
    with pytest.raises(KafkaTimeoutError):
        runner.poll_once()
    assert read_all(bus, "rollouts") == []
    assert runner.poll_once() and len(read_all(bus, "rollouts")) == 1, "the same outputs, sent again"
    runner.poll_once()  # batch 1: kept aside until actor v1
    generator.stop(finished=False)
    successor = started(GeneratorService(config, "generator-b"), bus)
    successor.poll_once()
    assert [held.message.step for held in successor.held] == [1], "batch 0 was committed once its outputs were out"
    (rollouts,) = [decode(v) for v in read_all(bus, "rollouts")]
    assert rollouts.step == 0


def test_the_generator_holds_a_batch_until_the_weights_allow_it(bus, config):
    generator = GeneratorService(config)  # max_staleness = 0
    runner = started(generator, bus)
    feeder = FeederService(config)
    publish(bus, "prompts", encode(feeder.batch(0)), encode(feeder.batch(1)))
    assert runner.poll_once() is True  # batch 0, sampled by v0
    assert runner.poll_once() is True  # batch 1 polled and held
    assert runner.poll_once() is False  # nothing to do until new weights
    produced = read_all(bus, "rollouts")
    assert len(produced) == 1, "batch 1 must wait for actor v1"
    assert "waits for the learner to have used up more than 0 groups" in runner.waiting_for()  # an update
    # The learner publishes v1: the held batch is now sampled, by v1.
    publish(bus, "weights", *[encode(a) for a in announce_v1(config)])
    assert runner.poll_once()
    rollouts = [decode(v) for v in read_all(bus, "rollouts")]
    assert [r.policy_version for r in rollouts] == [0, 1]


def test_a_replica_that_starts_late_catches_up_to_the_newest_weights(bus, config, caplog):
    """Announcements v1 and v2 are on the weights topic before the generator starts: it loads v2 only."""
    import logging

    publish(bus, "weights", *[encode(a) for a in announce_v1(config, version=1)])
    newest = announce_v1(config, version=2)
    publish(bus, "weights", *[encode(a) for a in newest])
    generator = GeneratorService(config)
    runner = started(generator, bus)
    with caplog.at_level(logging.INFO):
        runner.poll_once()
    assert generator.policy_version == 2
    assert "actor weights v2 loaded" in caplog.text and "actor weights v1 loaded" not in caplog.text
    actor = next(a for a in newest if a.model == "actor")
    with safe_open(actor.uri, "pt") as snapshot:
        assert torch.equal(generator.sampler.model.model.norm.weight, snapshot.get_tensor("model.norm.weight"))


def test_a_corrupted_snapshot_is_rejected_and_the_old_weights_kept(bus, config, caplog):
    generator = GeneratorService(config)
    runner = started(generator, bus)
    announcements = announce_v1(config)
    actor = next(a for a in announcements if a.model == "actor")
    with open(actor.uri, "r+b") as fh:
        fh.seek(100)
        fh.write(b"\xff\xff\xff\xff")
    before = {k: v.clone() for k, v in generator.sampler.model.state_dict().items()}
    publish(bus, "weights", encode(actor))
    runner.poll_once()
    assert generator.policy_version == 0
    assert all((before[k] == v).all() for k, v in generator.sampler.model.state_dict().items())
    assert "keeping actor v0" in caplog.text and "has blake3" in caplog.text


def test_a_held_batch_does_not_block_other_partitions(bus, config):
    """Kafka orders records per partition only: batch 1 may sit behind a held batch 2 in another partition."""
    generator = GeneratorService(config)
    runner = started(generator, bus)
    feeder = FeederService(config)
    batches = {step: feeder.batch(step) for step in range(6)}
    publish_in_order = sorted(batches, key=lambda step: (step % 2 == 0, step))  # odd steps first, then even
    producer = bus.producer("test")
    keys = _keys_for_each_partition(2)
    for step in publish_in_order:
        producer.send("prompts", encode(batches[step]), key=keys[step % 2])  # odd and even steps apart
    sampled = []
    for version in range(6):
        if version:
            publish(bus, "weights", *[encode(a) for a in announce_v1(config, version)])
        while runner.poll_once():
            pass
        sampled = sorted((decode(v) for v in read_all(bus, "rollouts")), key=lambda r: r.step)
        assert [r.step for r in sampled] == list(range(version + 1)), "each batch as soon as its weights exist"
    assert [r.policy_version for r in sampled] == list(range(6))


def _keys_for_each_partition(count):
    import zlib

    keys = {}
    for i in range(1000):
        keys.setdefault(zlib.crc32(f"k{i}".encode()) % count, f"k{i}".encode())
    return [keys[p] for p in range(count)]


def test_messages_of_another_run_are_skipped(bus, config):
    runner = started(GeneratorService(config, "generator"), bus)
    other = FeederService(
        config.model_copy(update={"run": config.run.model_copy(update={"run_id": "another-run"})})
    ).batch(0)
    publish(bus, "prompts", encode(other), encode(FeederService(config).batch(0)))
    runner.poll_once(), runner.poll_once()
    (rollouts,) = [decode(v) for v in read_all(bus, "rollouts")]
    assert rollouts.lineage["run.id"] == config.run.run_id
    assert runner.counters["other_runs"] == 1


def test_the_learner_refuses_experience_from_a_newer_policy(bus, config):
    from services.advantage import AdvantageService

    message = FeederService(config).batch(0)
    for stage in (GeneratorService, ScorerService, AdvantageService):
        message = stage(config).process(message)[0]
    real = encode(message)
    forged = sampled_by(message, 5)  # sampled by weights this learner never published, under the real batch's id
    lying = dataclasses.replace(message, policy_version=5)  # a header that its tokens' versions contradict
    learner = LearnerService(config)
    runner = started(learner, bus)
    publish(bus, "experience", encode(forged), encode(lying))
    assert runner.poll_once()
    assert learner.trainer.version == 0 and learner.dropped_stale == 2 and not learner.done()  # its two groups
    assert runner.counters["dropped"] == 1 and runner.counters["processed"] == 0
    assert runner.poll_once()
    (letter,) = [decode(v) for v in read_all(bus, "experience.dlq")]
    assert "policy_version 5 is not the oldest of token_versions (0)" in letter.error
    assert read_all(bus, "weights") == [], "nothing announced"
    publish(bus, "experience", real)
    assert runner.poll_once()
    assert runner.counters["processed"] == 1 and runner.counters["duplicates"] == 0, "the forgery took no place"
    assert learner.trainer.version == 1 and len(read_all(bus, "weights")) == 2


def test_a_prompt_batch_outside_the_run_goes_to_the_dlq_instead_of_blocking(bus, config):
    runner = started(GeneratorService(config, "generator"), bus)
    feeder = FeederService(config)
    forged = feeder.batch(0)
    forged.step = 10**9  # far in the future: held, it would pause its partition for good
    publish(bus, "prompts", encode(forged), encode(feeder.batch(0)))
    assert runner.poll_once() and runner.poll_once()
    (letter,) = [decode(v) for v in read_all(bus, "prompts.dlq")]
    assert "outside the run" in letter.error and runner.counters["dead_letters"] == 1
    assert runner.counters["processed"] == 1 and not runner.held


def test_status_reports_counters_and_lag(bus, config):
    runner = started(GeneratorService(config, "generator"), bus)
    feeder = FeederService(config)
    publish(bus, "prompts", encode(feeder.batch(0)), encode(feeder.batch(1)), encode(feeder.batch(2)), b"junk")
    runner.poll_once()
    status = runner.status()
    assert status["processed"] == 1 and status["lag"] == 3 and status["held"] == 0


def test_the_learners_kl_coefficient_reaches_the_advantage_service(config):
    from services.advantage import AdvantageService

    learner = LearnerService(config)
    learner.trainer.kl_controller.value = 0.5  # as an adaptive controller might have moved it
    learner.trainer.version = 1
    critic_announcement = next(a for a in learner.announce() if a.model == "critic")
    advantage = AdvantageService(config)
    advantage.on_weights(critic_announcement)
    scored = ScorerService(config).process(GeneratorService(config).process(FeederService(config).batch(0))[0])[0]
    experience = advantage.process(scored)[0]
    assert experience.lineage["shaping.kl_coef"] == 0.5 and experience.lineage["critic.version"] == 1
    mask = np.arange(experience.kl.shape[1]) < experience.response_lengths[:, None]
    last = experience.response_lengths - 1
    shaped = -0.5 * experience.kl * mask
    shaped[np.arange(len(last)), last] += experience.scores
    assert np.allclose(experience.token_rewards, shaped, atol=1e-6)


def test_a_record_kept_aside_blocks_neither_its_partition_nor_the_run_and_is_never_committed_past(bus, make_config):
    """A prompt batch of a later step (inside the run: forged, or read ahead) at the head of a partition waits for
    weights that do not come. The real batch behind it is sampled at once; input is committed only below the one
    kept aside, so a replica that takes over reads it again; once nothing could be processed for hold_timeout_s it
    goes to the DLQ and the partition is committed past it."""
    config = make_config(
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "learner.mini_batch_size=4",
        "pipeline.hold_timeout_s=0.5",
    )
    generator = started_replica(GeneratorService(config, "generator"), bus)
    runner = generator.runner
    feeder = FeederService(config)
    publish(bus, "prompts", encode(feeder.batch(30)), encode(feeder.batch(0)))  # one key: one partition, in order
    assert runner.poll_once() and [held.message.step for held in runner.held] == [30], "step 30 waits for actor v30"
    assert runner.poll_once(), "reading goes on past it"
    (rollouts,) = [decode(v) for v in read_all(bus, "rollouts")]
    assert rollouts.step == 0
    generator.stop(finished=False)  # commits what it can: below step 30
    taking_over = started_replica(GeneratorService(config, "generator-b"), bus)
    successor = taking_over.runner
    assert successor.poll_once() and [held.message.step for held in successor.held] == [30], "not committed past"
    assert successor.poll_once() and successor.counters["processed"] == 1, "step 0 again: committed below 30"
    assert not successor.poll_once()
    time.sleep(0.6)
    assert successor.poll_once()  # the bound has passed with nothing to do: step 30 is dead-lettered
    (letter,) = [decode(v) for v in read_all(bus, "prompts.dlq")]
    assert "held" in letter.error and "to have used up more than 58 groups" in letter.error
    taking_over.stop(finished=False)
    last = started(GeneratorService(config, "generator-c"), bus)
    assert not last.poll_once() and not last.held, "committed past both"


def test_consecutive_steps_go_to_consecutive_partitions(bus, make_config):
    """Replicas own partitions: by step, each of R replicas gets every R-th batch (a hash of ids gives some more)."""
    config = make_config(
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "learner.mini_batch_size=4",
        "pipeline.max_staleness=3",
    )
    runner = started(GeneratorService(config), bus)
    feeder = FeederService(config)
    publish(bus, "prompts", *[encode(feeder.batch(step)) for step in range(4)])
    while runner.poll_once():
        pass
    records = bus.consumer("rollouts", None, "reader").poll(0.0, max_records=100)
    assert sorted((decode(r.value).step, r.partition) for r in records) == [(0, 0), (1, 1), (2, 0), (3, 1)]


BY_REFERENCE = [  # every batch over 1,000 bytes (all of these) travels by reference
    "data.batch_size=2",
    "generation.n=2",
    "generation.max_new_tokens=4",
    "learner.mini_batch_size=4",
    "pipeline.inline_max_bytes=1000",
]


@pytest.fixture
def by_reference(make_config):
    return make_config(*BY_REFERENCE)


def _rollouts_by_reference(bus, config) -> tuple[bytes, BatchReference]:
    publish(bus, "prompts", encode(FeederService(config).batch(0)))
    started(GeneratorService(config, "generator"), bus).poll_once()
    (record,) = read_all(bus, "rollouts")
    return record, decode(record)


@pytest.mark.parametrize("remove_committed", [False, True])
def test_a_batch_over_the_inline_limit_travels_by_reference_and_its_file_stays_as_its_record_does(
    bus, make_config, remove_committed
):
    """By default a referenced batch's file is kept while its record is (kafka.retention), so the log can be
    replayed and exported; with remove_committed_batches it goes once its reader commits past its record."""
    by_reference = make_config(*BY_REFERENCE, f"kafka.retention.remove_committed_batches={remove_committed}")
    record, reference = _rollouts_by_reference(bus, by_reference)
    assert isinstance(reference, BatchReference) and reference.carries == "rollouts" and len(record) < 1000
    path = Path(reference.uri)
    assert path.parent == by_reference.batch_store and path.stat().st_size == reference.num_bytes > 1000
    rollouts = decode(BatchStore.get(reference), expected=RolloutBatch)
    scorer = started(ScorerService(by_reference, "scorer"), bus)
    assert scorer.poll_once() and scorer.counters["processed"] == 1
    (scored_reference,) = [decode(v) for v in read_all(bus, "scored")]
    scored = decode(BatchStore.get(scored_reference))
    assert scored.batch_id == rollouts.batch_id
    assert np.array_equal(scored.response_tokens, rollouts.response_tokens)
    assert path.exists() != remove_committed, "the scorer committed past the rollouts"
    assert Path(scored_reference.uri).exists(), "not yet consumed"


@pytest.mark.parametrize("damage", ["missing", "altered", "another message"])
def test_a_reference_that_cannot_be_resolved_is_a_dead_letter(bus, by_reference, damage):
    record, reference = _rollouts_by_reference(bus, by_reference)
    path = Path(reference.uri)
    if damage == "missing":
        path.unlink()
    elif damage == "altered":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    else:  # a reference to a prompts batch, on the rollouts topic
        prompts = FeederService(by_reference).batch(1)
        record = encode(BatchStore(by_reference.batch_store).put(prompts, encode(prompts)))
        bus = MemoryBus()
        bus.create_topics(pipeline_topics(partitions=2))
        publish(bus, "rollouts", record)
    scorer = started(ScorerService(by_reference, "scorer"), bus)
    assert scorer.poll_once()
    (letter,) = [decode(v) for v in read_all(bus, "rollouts.dlq")]
    assert letter.payload == record, "the dead letter holds the reference as it was read"
    expected = {"missing": "cannot read", "altered": "do not match", "another message": "a 'prompts' message"}
    assert expected[damage] in letter.error
    assert scorer.counters["dead_letters"] == 1 and not read_all(bus, "scored")
    assert path.exists() == (damage != "missing"), "a dead-lettered reference keeps its file"


def test_a_batch_id_cannot_place_its_file_outside_the_store(by_reference):
    batch = FeederService(by_reference).batch(0)
    batch.batch_id = "../../escaped/x"
    reference = BatchStore(by_reference.batch_store).put(batch, encode(batch))
    assert Path(reference.uri).parent == by_reference.batch_store
    assert decode(BatchStore.get(reference)).batch_id == "../../escaped/x"


def test_inline_batches_must_fit_a_record(make_config):
    from common.config import ConfigError

    with pytest.raises(ConfigError, match="inline_max_bytes"):
        make_config("kafka.max_message_bytes=1048576", "pipeline.inline_max_bytes=1048576")


def test_with_a_signing_key_a_forged_prompt_batch_and_a_forged_snapshot_are_refused(bus, make_config, monkeypatch):
    """A writer with access to the topics and the weight store, but not the run's key: its prompt batch of an in-run
    step, and its snapshot announced with a recomputed digest, are dead letters; the real ones go through."""
    import dataclasses

    from common.signing import Signer
    from common.weights import WeightStore

    monkeypatch.setenv("RUN_SIGNING_KEY", "the run's own key")
    config = make_config(
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "learner.mini_batch_size=4",
        "pipeline.max_staleness=1",
        "pipeline.signing_key_env=RUN_SIGNING_KEY",
    )
    feeder = FeederService(config)
    real = feeder.batch(0)
    forged = dataclasses.replace(real, prompt_text=["forged", "forged"], lineage=dict(real.lineage))
    publish(bus, "prompts", encode(forged))  # first in its partition, where the real batch 0 follows
    started(feeder, bus)  # publishes the run's batches, signed
    generator = GeneratorService(config)
    runner = started(generator, bus)
    while runner.poll_once():
        pass
    assert runner.counters["unsigned"] == 1 and runner.counters["dead_letters"] == 1
    letter = decode(read_all(bus, "prompts.dlq")[0])
    assert "unsigned or signed with another key" in letter.error
    rollouts = [decode(v) for v in read_all(bus, "rollouts")]
    assert {r.step for r in rollouts} == {0, 1} and "forged" not in rollouts[0].prompt_text, "the real batch 0"

    # A forged snapshot: its own weights, a digest computed for them, an announcement signed with another key.
    real_v1 = {a.model: a for a in announce_v1(config)}
    forger = LearnerService(config)
    with torch.no_grad():
        for p in forger.trainer.actor.parameters():
            p.mul_(-1.0)
    forged_store = WeightStore(config.run.dir / "forged")
    snapshot = forged_store.save_state("actor", 1, forger.trainer.full_state("actor"))
    fake = dataclasses.replace(
        real_v1["actor"],
        uri=snapshot.uri,
        digest=snapshot.digest,
        chain=list(snapshot.chain),
        lineage=dict(real_v1["actor"].lineage),
    )
    Signer(b"another key").sign(fake)
    publish(bus, "weights", encode(fake))
    runner.poll_once()
    assert generator.policy_version == 0 and runner.counters["unsigned"] == 2, "the forgery is refused"
    Signer(b"the run's own key").sign(real_v1["actor"])
    publish(bus, "weights", encode(real_v1["actor"]))
    runner.poll_once()
    assert generator.policy_version == 1, "the run's own v1 is loaded"


def test_a_signing_key_that_cannot_be_read_is_a_configuration_error(make_config, monkeypatch):
    from common.config import ConfigError

    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    config = make_config("pipeline.signing_key_env=NO_SUCH_KEY")
    with pytest.raises(ConfigError, match="environment variable NO_SUCH_KEY is not set"):
        started(FeederService(config), MemoryBus())


# Records any client of the broker can write, each of which once stopped a replica (or would have).
HOSTILE_RECORDS = {
    "null value": (None, b"k"),
    "null value and key": (None, None),
    "empty value": (b"", b"k"),
    "null key": (b"\x93garbage", None),
    "a key of a megabyte": (b"\x93garbage", b"k" * (1 << 20)),
    "a value as large as a record may be": (b"\xc1" * (2 << 20), b"k"),
}


@pytest.mark.parametrize("shape", HOSTILE_RECORDS)
@pytest.mark.parametrize("topic", ["prompts", "rollouts", "scored", "experience"])
def test_no_record_a_client_can_write_stops_a_replica(bus, make_config, topic, shape):
    """Each is dead-lettered (the letter carries what came in, cut to what a record holds, and says so), committed
    past, and the valid record behind it processed."""

    config = make_config(
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "learner.mini_batch_size=4",
        f"kafka.max_message_bytes={2 << 20}",
    )
    service = consumer_of(topic)(config, f"{topic}-consumer")
    runner = started(service, bus)
    value, key = HOSTILE_RECORDS[shape]
    publish(bus, topic, value, key=key)
    publish(bus, topic, _valid_input(bus, config, topic))
    assert runner.poll_once() and runner.poll_once()
    (letter,) = [decode(v) for v in read_all(bus, f"{topic}.dlq")]
    assert letter.source_topic == topic and letter.source_offset == 0
    assert len(encode(letter)) <= config.kafka.max_message_bytes
    if value is None:
        assert letter.payload == b"" and "null" in letter.error
    elif len(value) > config.kafka.max_message_bytes // 2:
        assert value.startswith(letter.payload) and f"of {len(value)} bytes" in letter.error
    else:
        assert letter.payload == value
    assert runner.counters["processed"] == 1 and runner.counters["dead_letters"] == 1
    assert not runner.offsets.uncommitted, "the hostile record and the valid one are committed past"


def test_a_tombstone_on_the_weights_topic_is_taken_as_one_and_the_weights_stay(bus, config):
    """A null value on a compacted topic is Kafka's deletion of its key's record: nothing to load, no dead letter."""
    generator = GeneratorService(config, "generator")
    runner = started(generator, bus)
    actor = next(a for a in announce_v1(config) if a.model == "actor")
    publish(bus, "weights", encode(actor), key=b"actor")
    publish(bus, "weights", None, key=b"actor")
    publish(bus, "prompts", encode(FeederService(config).batch(0)))
    for _ in range(3):
        runner.poll_once()
    assert runner.counters["tombstones"] == 1 and runner.counters["dead_letters"] == 0
    assert runner.weights.loaded == {"actor": 1}
    assert runner.counters["processed"] == 1


def test_a_replica_says_it_is_starting_before_its_models_load(bus, config):
    """What `streamppo status` shows of a replica whose models still load (minutes on a CPU): starting, and what."""
    from services.launch.process import say_starting
    from services.ops.status import format_status, read_status

    say_starting(bus, config, "scorer", "scorer-0")
    table = format_status(read_status(bus, config.run.run_id, timeout_s=5))
    assert "run vowels: 1 replica(s) reporting" in table
    row = next(line for line in table.splitlines() if line.startswith("scorer-0"))
    assert row.split()[1] == "starting", row
    assert f"waiting on building its service: the models it runs load first (model.actor {config.model.actor}" in table


def test_an_evaluator_behind_the_learner_takes_the_newest_version_due_and_says_which_it_skipped(make_config, caplog):
    from conftest import EXAMPLE

    from services.evaluator import EvaluatorService

    config = make_config(
        "data.batch_size=2", "generation.n=2", "generation.max_new_tokens=4", "learner.mini_batch_size=4",
        "run.steps=8", f"eval.prompts={EXAMPLE / 'heldout.jsonl'}", "eval.every=2", "eval.max_prompts=2",
    )  # fmt: skip
    evaluator = EvaluatorService(config, "evaluator-0")
    assert evaluator.tick() == [] and evaluator.evaluated == {0}, "v0 first: the model as it starts"
    for version in (2, 3, 6):  # v2 replaced before a tick; v4 never announced to it at all
        actor = next(a for a in announce_v1(config, version) if a.model == "actor")
        assert evaluator.on_weights(actor)
    assert evaluator.skipped == [2, 4] and evaluator.due == 6
    assert "skipping v2: v3 came out before it was evaluated" in caplog.text
    assert "skipping v4: v6 came out before it was evaluated" in caplog.text
    evaluator.tick()
    assert evaluator.evaluated == {0, 6} and not evaluator.done()
    assert [json.loads(line)["policy_version"] for line in (config.run.dir / "eval.jsonl").open()] == [0, 6]
