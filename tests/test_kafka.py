"""The Kafka bus and the services as processes, against a real broker started by the tests."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from conftest import EXAMPLE, REPO
from helpers import (
    assert_each_group_once,
    broker_address,
    experience_of_steps,
    is_local_broker,
    run_settings,
    sampled_by,
    started,
    started_replica,
)
from kafka.errors import KafkaError

from common.schema import DeadLetter, SchemaError, decode
from services.runtime.run_bus import kafka_bus
from services.transport import TopicSpec
from services.transport.brokers.local_broker import free_port
from services.transport.kafka import BrokerUnavailable, KafkaBus, KafkaSettings

pytestmark = pytest.mark.slow  # services as processes and a broker per test where it needs one


@pytest.fixture
def kafka_config(make_config, kafka_broker):
    return make_config(*kafka_broker)


@pytest.fixture
def bus(kafka_config):
    return kafka_bus(kafka_config)


def streamppo_command(*args: str, overrides: list[str] = (), config: str = "config.yaml") -> list[str]:
    """``python -m services.cli ARGS --config <the example's config> --set OVERRIDE ...``."""
    command = [sys.executable, "-m", "services.cli", *args, "--config", str(EXAMPLE / config)]
    return command + [a for o in overrides for a in ("--set", o)]


def up_command(kafka_broker, tmp_path, model_cache, steps, run_id, overrides, up_args, config, verbose) -> list[str]:
    """`streamppo up` on the test's broker for a run of ``steps`` under ``tmp_path/run``."""
    bootstrap = broker_address(kafka_broker)
    settings = [*run_settings(tmp_path, model_cache, steps, run_id), *overrides, *kafka_broker]
    flags = ["-v"] if verbose else []
    return streamppo_command(*flags, "up", "--bootstrap", bootstrap, *up_args, overrides=settings, config=config)


def start_up(kafka_broker, tmp_path, model_cache, steps, run_id, up_args=(), overrides=(), verbose=False):
    """`streamppo up` in the background (its own session, transformers generator) for a run of ``steps``; returns
    the process, its log file (every service's INFO lines with ``verbose``) and the run's metrics.jsonl."""
    overrides = ["generation.backend=transformers", *overrides]
    args = up_command(kafka_broker, tmp_path, model_cache, steps, run_id, overrides, up_args, "config.yaml", verbose)
    output, metrics = tmp_path / "up.log", tmp_path / "run" / "metrics.jsonl"
    with open(output, "w") as log:
        up = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return up, output, metrics


def run_up(kafka_broker, tmp_path, model_cache, steps, run_id, overrides=(), up_args=(), config="config.yaml"):
    """`streamppo -v up` for a run of ``steps`` to its end; returns the finished process (output captured)."""
    args = up_command(kafka_broker, tmp_path, model_cache, steps, run_id, overrides, up_args, config, verbose=True)
    up = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = up.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)  # up and every service it started
        stdout, stderr = up.communicate()
        pytest.fail(f"the run did not end in 600 s:\n{stdout[-3000:]}")
    result = subprocess.CompletedProcess(args, up.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def run_messages(config, topic, run_id, count, timeout_s=60.0) -> dict:
    """The messages of run ``run_id`` on ``topic``, by batch id, once ``count`` are there (other tests' garbage on
    the shared topics is skipped)."""
    of_the_run = config.model_copy(update={"run": config.run.model_copy(update={"run_id": run_id})})  # its namespace
    audit = kafka_bus(of_the_run).consumer(topic, None, "audit")
    found, deadline = {}, time.monotonic() + timeout_s
    while len(found) < count and time.monotonic() < deadline:
        for record in audit.poll(0.5, max_records=1000):
            try:
                message = decode(record.value)
            except SchemaError:
                continue
            if message.batch_id.startswith(run_id):
                found[message.batch_id] = message
    return found


def up_on_a_broker_of_its_own(tmp_path, model_cache, steps, run_id, port, log_name, *up_args, settings=()):
    """`streamppo -v up` in the background on the broker at ``port`` (one the test kills and replaces), its output in
    ``tmp_path/log_name``; the services wait up to 2 minutes for a broker that is away."""
    overrides = [
        *run_settings(tmp_path, model_cache, steps, run_id),
        "generation.backend=transformers",
        "kafka.idempotent_producer=false",
        "kafka.connect_timeout_s=120",
        *settings,
    ]
    args = streamppo_command("-v", "up", "--bootstrap", f"127.0.0.1:{port}", *up_args, overrides=overrides)
    with open(tmp_path / log_name, "w") as log:
        return subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def unique(name):
    return f"{name}-{uuid.uuid4().hex[:8]}"


def drain(consumer, expected, timeout_s=30.0, commit=True):
    seen, deadline = [], time.monotonic() + timeout_s
    while len(seen) < expected and time.monotonic() < deadline:
        for record in consumer.poll(0.5, max_records=100):
            seen.append(record.value)
            if commit:
                consumer.commit(record)
    return seen


def fill(bus, topic, count):
    producer = bus.producer("test")
    for i in range(count):
        producer.send(topic, f"v{i}".encode(), key=f"k{i}".encode())
    producer.flush()


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


def test_replicas_that_make_the_log_at_once_all_read_its_one_identity(kafka_config):
    """Services started together on an empty broker, with no `streamppo topics` first: each makes the run's topics
    (racing the others) and its identity if it reads none; the first record is the log's, and each reads that one
    back, never none (a feeder under compose once read none back, its probe's high watermark still that of the
    empty partition; learners and advantage services of a fleet once read none while the topic was not yet in the
    broker's metadata, and crashed)."""
    import concurrent.futures

    from services.roles import LOG_TOPIC

    for attempt in range(4):
        config = kafka_config.model_copy(update={"run": kafka_config.run.model_copy(update={"run_id": unique("id")})})

        def start_replica(_, config=config):
            bus = kafka_bus(config)  # what every process does first: the topics made, the log's identity written
            return bus, bus.log_identity(LOG_TOPIC, create=True)  # and what its runner reads

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            started = list(pool.map(start_replica, range(6)))
        read = [identity for _, identity in started]
        assert None not in read and len(set(read)) == 1, (attempt, read)
        assert started[0][0].log_identity(LOG_TOPIC) == read[0], "what a later check reads: the same log"
        for bus, _ in started:
            bus.close()


def test_making_the_log_identity_waits_for_a_topic_made_a_moment_ago(kafka_config):
    """The topic is made while log_identity(create=True) asks: it answers the identity, never None."""
    import threading

    from services.roles import LOG_TOPIC, pipeline_topics

    config = kafka_config.model_copy(update={"run": kafka_config.run.model_copy(update={"run_id": unique("late")})})
    bus, maker = kafka_bus(config, make=False), kafka_bus(config, make=False)
    threading.Timer(1.5, maker.create_topics, args=(pipeline_topics(1),)).start()
    identity = bus.log_identity(LOG_TOPIC, create=True)
    assert identity and identity == maker.log_identity(LOG_TOPIC)
    bus.close(), maker.close()


def test_an_unreachable_broker_is_a_clear_error():
    bus = KafkaBus(KafkaSettings(bootstrap=f"127.0.0.1:{free_port()}", connect_timeout_s=2))
    with pytest.raises(BrokerUnavailable, match="no Kafka broker reachable"):
        bus.producer("p")


@pytest.mark.slow
def test_streamppo_up_runs_every_role_as_processes_with_lora_on_the_vllm_generator(
    own_broker, make_config, tmp_path, model_cache
):
    """`streamppo up` with two scorer replicas, each service its own process over the broker, the generator the one a
    user gets (vLLM when installed). LoRA on the actor: snapshots hold the adapters alone, and the generator, which
    swaps them in at each version over its base weights, samples with the log-probs the learner computes (float32)."""
    from safetensors.torch import load_file

    steps, run_id = 6, unique("lora")
    # The evaluator beside them: the held-out prompts at v0, v3 and v6, the adapters of each.
    held_out = ["eval.every=3", f"eval.prompts={EXAMPLE / 'heldout.jsonl'}", "eval.max_prompts=8"]
    overrides = ["model.lora={rank: 8, alpha: 16}", "learner.actor_lr=3e-2", *held_out]
    up_args = ("--replicas", "scorer=2")
    result = run_up(own_broker, tmp_path, model_cache, steps, run_id, overrides, up_args, config="grpo.yaml")
    assert "scorer-1 | " in result.stdout and "scorer-1: serving rollouts -> scored" in result.stdout, "prefixed logs"
    # It reports as `streamppo run` does: a line per update, the done line and summary.json.
    assert all(f"update {step}/{steps} (" in result.stdout for step in range(1, steps + 1)), result.stdout[-3000:]
    assert f"done: {steps} steps in" in result.stdout and "dead letters 0" in result.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == steps
    evaluated = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [line["policy_version"] for line in evaluated] == [0, 3, 6], result.stdout[-3000:]
    # `status` finds the run from its directory alone: the settings and the broker `up` wrote there.
    status = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--run-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert status.returncode == 0 and "learner-0" in status.stdout and "scorer-1" in status.stdout, status.stderr
    backend = "vllm" if importlib.util.find_spec("vllm") else "transformers"
    assert f"generator-0: sampling with the {backend} backend" in result.stdout
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert_each_group_once(records, run_id, steps)
    assert [r["staleness"] for r in records] == [0.0] * steps, "each batch sampled by the adapters of its version"
    # The adapters of each version, as the learner computes with them: the mean gap is float rounding; the worst
    # token of a run (a rare, low-probability one) was seen at 1.8e-4 (against ~0.1 with the wrong adapters).
    assert max(r["logprob_mismatch"] for r in records) < 1e-5, [r["logprob_mismatch"] for r in records]
    assert max(r["logprob_mismatch_max"] for r in records) < 1e-3, [r["logprob_mismatch_max"] for r in records]
    for snapshot in (run / "weights").glob("actor-*.safetensors"):
        assert all(".lora_A." in k or ".lora_B." in k for k in load_file(snapshot)), snapshot.name
    adapters = load_file(run / "final" / "actor" / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for k, t in adapters.items() if "lora_B" in k), "the adapters were trained"
    for version in range(1, steps):
        assert f"generator-0: actor weights v{version} loaded" in result.stdout
    scored = run_messages(make_config(*own_broker), "scored", run_id, steps)
    assert len(scored) == steps
    assert {m.lineage["scorer.replica"] for m in scored.values()} == {"scorer-0", "scorer-1"}, "both scorers worked"
    # The run's log outlives its broker: `streamppo archive` copies it into files, and `trace` reads them and names
    # the reward and the replicas that made an update.
    settings = [*run_settings(tmp_path, model_cache, steps, run_id), *overrides, *own_broker]
    made = archived_and_traced(tmp_path, settings, config="grpo.yaml")
    batches = [scored[batch_id] for batch_id in records[1]["batch_ids"]]
    assert made["groups"] and [g["group"] for g in made["groups"]] == records[1]["groups"]
    assert made["rewards"] == sorted({f"reward.function={b.lineage['reward.function']}" for b in batches})
    assert made["generators"] == ["generator-0"]
    assert made["scorers"] == sorted({b.lineage["scorer.replica"] for b in batches})


@pytest.mark.slow
@pytest.mark.soak
def test_a_judge_scores_a_run_over_the_broker(own_broker, make_config, tmp_path, model_cache):
    """`reward.judge`: the scorer process runs SmolLM2-135M-Instruct (no good judge, a real one) on each answer and
    parses its number; the run trains on the judge's scores, and every scored batch names its judge and how many of
    its answers got the default score; archive and trace name the judge. (make test: the same judge in process in
    test_judge.py, and the scorer's path over the broker in every run of processes.)"""
    steps, run_id = 2, unique("judge")
    judge = "{model: builtin:smollm2-135m-instruct, backend: transformers, max_new_tokens: 4}"
    overrides = [
        "reward.function=null",
        f"reward.judge={judge}",
        "generation.backend=transformers",
        "data.batch_size=4",
        "generation.n=2",
        "learner.mini_batch_size=8",
    ]
    run_up(own_broker, tmp_path, model_cache, steps, run_id, overrides)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(records) == steps
    scored = run_messages(make_config(*own_broker), "scored", run_id, steps)
    assert len(scored) == steps
    for message in scored.values():
        assert message.lineage["reward.judge"].startswith(str(model_cache / "models" / "smollm2-135m-instruct"))
        assert 0 <= message.lineage["reward.judge.unparsed"] <= len(message.scores)
        assert "reward.function" not in message.lineage
    # The learner trained on what the judge gave: each update's mean reward is its batch's mean score.
    by_step = {m.step: float(m.scores.mean()) for m in scored.values()}
    assert [r["reward_mean"] for r in records] == pytest.approx([by_step[s] for s in sorted(by_step)], abs=1e-6)
    # The run's log outlives its broker, with the judge named in what made an update.
    made = archived_and_traced(tmp_path, [*run_settings(tmp_path, model_cache, steps, run_id), *overrides, *own_broker])
    assert made["groups"] and [g["group"] for g in made["groups"]] == records[1]["groups"]
    assert made["rewards"] == [f"reward.judge={scored[records[1]['batch_ids'][0]].lineage['reward.judge']}"]
    assert made["generators"] == ["generator-0"] and made["scorers"] == ["scorer-0"]


def archived_and_traced(tmp_path, settings: list[str], update: int = 2, config: str = "config.yaml") -> dict:
    """`streamppo archive` of a finished run's log into files, then `streamppo trace --update` of one update read
    from them alone (the broker not asked): what trace says made that update."""
    archive = subprocess.run(
        streamppo_command("archive", "--out", str(tmp_path / "log"), overrides=settings, config=config),
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert archive.returncode == 0, archive.stderr
    trace = subprocess.run(
        [sys.executable, "-m", "services.cli", "trace", "--log", str(tmp_path / "log"),
         "--run-dir", str(tmp_path / "run"), "--update", str(update), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert trace.returncode == 0, trace.stderr
    return json.loads(trace.stdout)


def test_streamppo_topics_creates_the_pipeline_topics_on_a_fresh_broker(tmp_path):
    """What compose's `topics` job runs: every data topic with its partitions, its .dlq, and `weights`."""
    from kafka import KafkaConsumer
    from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

    from services.roles import pipeline_topics
    from services.transport.brokers.local_broker import LocalBroker

    with LocalBroker() as broker:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "topics",
                "--config",
                str(EXAMPLE / "config.yaml"),
                "--bootstrap",
                broker.bootstrap,
                "--set",
                "kafka.partitions=3",
                "--set",
                "kafka.idempotent_producer=false",
                "--set",
                "kafka.retention.topics={experience: {hours: 2, bytes: 1000000}}",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        probe = KafkaConsumer(bootstrap_servers=broker.bootstrap)
        try:
            existing = probe.topics()
            for spec in pipeline_topics(3):  # in the run's namespace, its run id by default
                name = f"vowels.{spec.name}"
                assert name in existing, name
                assert len(probe.partitions_for_topic(name)) == spec.partitions, name
        finally:
            probe.close()
        # kafka.retention: 7 days (Kafka's default, set explicitly) unless a topic says otherwise, its dead letters
        # alike; the compacted weights topic keeps its newest record per model for good.
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        try:
            topics = ["experience", "experience.dlq", "prompts", "weights"]
            (answer,) = admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, f"vowels.{t}") for t in topics]
            )
            kept = {res[3].removeprefix("vowels."): {c[0]: c[1] for c in res[4]} for res in answer.resources}
        finally:
            admin.close()
        assert kept["experience"]["retention.ms"] == kept["experience.dlq"]["retention.ms"] == str(2 * 3_600_000)
        assert kept["experience"]["retention.bytes"] == "1000000"
        assert kept["prompts"]["retention.ms"] == str(168 * 3_600_000)
        assert kept["weights"]["cleanup.policy"] == "compact"


def leave_mid_rebalance(bootstrap: str, topic: str, group: str) -> None:
    """Two plain kafka-python members of ``group`` take ``topic``'s partitions and commit offset 1 on each; then the
    follower leaves, and the leader leaves while the group rebalances. On the local broker (tansu) that wedges the
    group: it keeps naming the departed leader, and no member gets a partition again."""
    from kafka import KafkaConsumer
    from kafka.structs import OffsetAndMetadata

    def member(name):
        consumer = KafkaConsumer(
            bootstrap_servers=bootstrap.split(","),
            group_id=group,
            client_id=name,
            enable_auto_commit=False,
            session_timeout_ms=6000,  # Apache Kafka's least (group.min.session.timeout.ms)
            heartbeat_interval_ms=1000,
        )
        consumer.subscribe([topic])
        return consumer

    leader = member("leader")
    deadline = time.monotonic() + 30
    while not leader.assignment() and time.monotonic() < deadline:
        leader.poll(timeout_ms=200)
    follower = member("follower")
    while not (leader.assignment() and follower.assignment()) and time.monotonic() < deadline:
        leader.poll(timeout_ms=100)
        follower.poll(timeout_ms=100)
    assert leader.assignment() and follower.assignment(), "two members share the partitions"
    for consumer in (leader, follower):
        consumer.commit({tp: OffsetAndMetadata(1, "", -1) for tp in consumer.assignment()})
    follower.close()
    leader.poll(timeout_ms=50)  # the leader begins the rebalance the follower's leaving started ...
    leader.close()  # ... and leaves in the middle of it


def test_a_group_whose_leader_left_mid_rebalance_deals_out_its_partitions_again(kafka_broker):
    """Plain clients leave the group mid-rebalance; a replica that joins it then holds every partition, on any broker.
    The local broker (tansu 0.6) wedges such a group for good (it names the departed leader in every join, and no
    member of that group gets a partition again); the replica notices (members, joins, no assignment for longer
    than a few sessions) and moves on to the group's next generation, within seconds."""
    bootstrap = broker_address(kafka_broker)
    local = is_local_broker(kafka_broker)
    sessions = {"session_timeout_ms": 1000, "heartbeat_interval_ms": 250} if local else {}  # as `up` sets there
    bus = KafkaBus(KafkaSettings(bootstrap, idempotent_producer=not local, **sessions))
    topic, group = unique("wedge"), unique("group")
    bus.create_topics([TopicSpec(topic, 4)])
    leave_mid_rebalance(bootstrap, topic, group)
    started = time.monotonic()
    newcomer = bus.consumer(topic, group, "newcomer")
    while not newcomer.consumer.assignment() and time.monotonic() - started < 60:
        newcomer.poll(0.2, max_records=10)
    assigned, took = newcomer.consumer.assignment(), time.monotonic() - started
    moved = newcomer.group
    newcomer.close()
    print(f"\nthe newcomer held every partition {took:.1f} s after it joined (group {moved})")
    assert len(assigned) == 4, "the only member of the group holds every partition"
    assert took < 30, f"the wedge was left in {took:.1f} s"
    assert moved == (f"{group}~1" if local else group), "a new generation of the group only where it was wedged"


def test_a_replica_leaves_a_wedged_group_for_a_new_one_with_its_committed_offsets(kafka_broker):
    bootstrap = broker_address(kafka_broker)
    local = is_local_broker(kafka_broker)
    sessions = {"session_timeout_ms": 1000, "heartbeat_interval_ms": 250} if local else {}  # as `up` sets there
    bus = KafkaBus(KafkaSettings(bootstrap, idempotent_producer=not local, **sessions))
    topic, group = unique("wedge"), unique("group")
    bus.create_topics([TopicSpec(topic, 4)])
    producer = bus.producer("test")
    for i in range(8):  # two records per partition
        producer.send(topic, f"v{i}".encode(), partition=i % 4)
    producer.flush()
    leave_mid_rebalance(bootstrap, topic, group)  # the first record of each partition is committed
    replica = bus.consumer(topic, group, "replica")
    records = []
    deadline = time.monotonic() + 90
    while len(records) < 4 and time.monotonic() < deadline:
        records += replica.poll(0.5, max_records=10)
    assert sorted(r.value for r in records) == [b"v4", b"v5", b"v6", b"v7"], "what was committed is not read again"
    if local:  # the broker wedged the group, and the replica moved on (Apache Kafka does not wedge it)
        assert replica.group == f"{group}~1"
        late = bus.consumer(topic, group, "late")  # a replica that starts later joins the group in use
        assert late.group == f"{group}~1"
        late.close()
    replica.close()


def test_broadcast_readers_see_every_partition_from_the_start_and_leave_no_group(bus, kafka_config):
    from kafka import KafkaAdminClient

    topic, client = unique("broadcast"), unique("weights-reader")
    bus.create_topics([TopicSpec(topic, 3)])
    fill(bus, topic, 12)
    admin = KafkaAdminClient(bootstrap_servers=kafka_config.kafka.bootstrap.split(","), client_id="test-admin")
    groups = set()
    for _ in range(2):  # a restarted replica reads everything again, from the beginning
        reader = bus.consumer(topic, None, client)
        assert reader.consumer.consumer.config["group_id"] is None, "assigned its partitions, joined no group"
        assert sorted(drain(reader, 12)) == sorted(f"v{i}".encode() for i in range(12))
        groups |= {group for group, *_ in admin.list_consumer_groups()}  # while it reads (Apache Kafka lists them)
        reader.close()
    groups |= {group for group, *_ in admin.list_consumer_groups()}
    admin.close()
    assert not any(client in group for group in groups), f"a group per start: {groups}"


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
    deadline = time.monotonic() + 60
    while not (learner.done() and runner.counters["dead_letters"]) and time.monotonic() < deadline:
        runner.poll_once(0.2)
    serving.stop(finished=False)
    lines = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").read_text().splitlines()]
    trained = sorted(key for line in lines for key in line["groups"])
    assert trained == sorted(k for m in real for k in m.idempotency_keys()), "the real groups, each once"
    assert [line["step"] for line in lines] == [1, 2, 3] and learner.updates == 3, "updates count applied batches"
    assert learner.dropped_stale == 2 and runner.counters["dropped"] == 1, "the forgery's two groups were dropped"
    assert runner.counters["dead_letters"] == 1 and runner.counters["processed"] == 3
    assert runner.counters["duplicates"] == 1, "the replay was recognised"


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


def test_streamppo_status_shows_what_each_replica_waits_for(make_config, kafka_broker):
    from common.schema import encode, message_key
    from services.feeder import FeederService
    from services.generator import GeneratorService

    run_id = unique("status")
    config = make_config(
        *kafka_broker,
        f"run.run_id={run_id}",
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "data.eval_prompts=0",
        "learner.mini_batch_size=4",
    )
    bus = kafka_bus(config)
    feeder = FeederService(config)
    producer = bus.producer("test")
    for message in (feeder.batch(0), feeder.batch(1)):  # on-policy: batch 1 waits for actor v1
        producer.send("prompts", encode(message), key=message_key(message))
    producer.send("prompts.dlq", b"a rejected record")
    producer.flush()
    replica = unique("generator")
    serving = started_replica(GeneratorService(config, replica), bus)
    runner = serving.runner
    deadline = time.monotonic() + 60
    while not (runner.counters["processed"] == 1 and runner.held) and time.monotonic() < deadline:
        runner.poll_once(0.2)
    assert runner.held, "batch 1 is held"
    runner.publish_status()
    held_gauge = runner.metrics.registry.get_sample_value("streamppo_held_records", {"role": "generator"})
    assert held_gauge == 1, "exported as a metric too"
    bootstrap = config.kafka.bootstrap

    def status(of_run):
        command = streamppo_command("status", "--bootstrap", bootstrap, overrides=[f"run.run_id={of_run}"])
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)

    result = status(run_id)
    serving.stop(finished=False)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert f"run {run_id}: 1 replica(s) reporting" in out
    (row,) = [line for line in out.splitlines() if line.startswith(replica)]
    assert row.split()[1:4] == ["waiting", "0", "1"], row  # state, lag, held
    assert "prompt batch 1 waits for the learner to have used up more than 0 groups" in out and "prompts[" in out
    assert "newest weights: none" in out
    dlq = dict(item.rsplit(" ", 1) for item in out.split("dead letters: ")[1].strip().split(", "))
    assert int(dlq["prompts.dlq"]) >= 1
    # A run that never started: said so, and nothing made for it (a reader makes no log).
    never = unique("never")
    result = status(never)
    assert result.returncode == 1 and f"no log of run {never!r}" in result.stderr, result.stderr[-2000:]
    probe = KafkaBus(KafkaSettings(bootstrap))._metadata_probe()
    assert not [topic for topic in probe.topics() if topic.startswith(never)]
    probe.close()


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


def test_a_weights_topic_the_broker_made_on_its_own_is_refused_by_services_and_replaced_by_topics(
    tmp_path, make_config
):
    from services.transport import TopicMismatch
    from services.transport.brokers.local_broker import LocalBroker

    with LocalBroker(log_path=tmp_path / "broker.log") as broker:
        # What a broker does when a client names a topic it lacks (if the client allows it): a topic of its defaults.
        config = make_config(f"kafka.bootstrap={broker.bootstrap}", "kafka.idempotent_producer=false")
        weights = f"{config.namespace}.weights"
        KafkaBus(KafkaSettings(broker.bootstrap, idempotent_producer=False)).create_topics([TopicSpec(weights, 4)])
        with pytest.raises(TopicMismatch, match=f"topic {weights} has 4 partition.s. and cleanup.policy=delete"):
            kafka_bus(config)  # what every service does at its start
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "-v",
                "topics",
                "--config",
                str(EXAMPLE / "config.yaml"),
                "--bootstrap",
                broker.bootstrap,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"replacing topic {weights} has 4 partition(s)" in result.stderr
        kafka_bus(config).close()  # accepted now: one partition, compacted


@pytest.mark.slow
@pytest.mark.soak
def test_a_broker_replaced_mid_run_costs_seconds_and_no_operator_and_resume_finishes_it(tmp_path, model_cache):
    """The broker dies and an empty one takes its place. Nobody acting, the services notice and go on on the new log
    in their processes, models kept: the learner checkpoints first and announces on the new log, the feeder publishes
    again from the first prompt batch that announcement says is not settled, and no process is started again. Then the
    stall an independent check found: services that lived on the new broker a while are stopped by an operator, who
    runs `up --resume` on that same broker; groups and offsets there belong to the logs they were made on (groups are
    named after the log), and the run finishes with every version applied exactly once. Mid-stream: the generator
    streams records of 4 groups, and an update takes 8 groups, half a prompt batch, so prompt batches are settled in
    part when the broker goes, and no group is lost or repeated."""
    from common.checkpoint import load_latest_checkpoint
    from services.transport.brokers.local_broker import LocalBroker, free_port

    steps, run_id, port = 16, unique("loss"), free_port()
    prompt_batches = steps * 8 // 16  # updates × groups per update, in batches of 16 prompts
    broker = LocalBroker(port, log_path=tmp_path / "broker-1.log").start()
    metrics = tmp_path / "run" / "metrics.jsonl"
    streaming = ("generation.streaming=true", "generation.groups_per_record=4", "learner.groups_per_update=8")
    roles = ("feeder", "generator", "scorer", "advantage", "learner")

    def up(log_name, *up_args):
        return up_on_a_broker_of_its_own(
            tmp_path, model_cache, steps, run_id, port, log_name, *up_args, settings=streaming
        )

    def lines():
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def went_on(role):
        return re.search(rf"{role}-0: .*going on on the new log", (tmp_path / "up-1.log").read_text()) is not None

    first = up("up-1.log")
    try:
        deadline = time.monotonic() + 300
        while lines() < 4:
            assert time.monotonic() < deadline and first.poll() is None, (tmp_path / "up-1.log").read_text()[-3000:]
            time.sleep(0.2)
        broker.stop()  # every record, offset and group is gone with it
        broker = LocalBroker(port, log_path=tmp_path / "broker-2.log").start()
        back = time.monotonic()
        # What the learner applied before it saw the log gone is in its checkpoint and metrics.jsonl by then.
        while not went_on("learner"):
            assert time.monotonic() < back + 300 and first.poll() is None, (tmp_path / "up-1.log").read_text()[-3000:]
            time.sleep(0.1)
        before = lines()
        while lines() <= before:
            assert time.monotonic() < back + 300 and first.poll() is None, (tmp_path / "up-1.log").read_text()[-3000:]
            time.sleep(0.1)
        print(f"\nfirst update {time.monotonic() - back:.1f} s after the new broker started, nobody acting")
        time.sleep(5)  # the services work on the new broker a while
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=180)
        checkpointed = lines()
        assert checkpointed < steps
        settled = load_latest_checkpoint(tmp_path / "run" / "checkpoints")[1]["ledger"]["below"]
        second = up("up-2.log", "--resume")
        assert second.wait(timeout=600) == 0, (tmp_path / "up-2.log").read_text()[-3000:]
    finally:
        for process in (first, locals().get("second")):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        broker.stop()
    automatic = (tmp_path / "up-1.log").read_text()
    assert all(went_on(role) for role in roles), "every service went on on the new log in its process"
    assert "again in resume mode" not in automatic, "no process was started again"
    published = re.findall(r"feeder-0: publishing prompt batches (\d+)\.\.", automatic)
    assert len(published) == 2 and int(published[1]) > 0, (
        f"published again from the learner's settled batch: {published}"
    )
    records = [json.loads(line) for line in metrics.open()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "every version applied exactly once"
    assert_each_group_once(records, run_id, prompt_batches)
    resumed = (tmp_path / "up-2.log").read_text()
    assert f"publishing prompt batches {settled}..{prompt_batches - 1}" in resumed, "the feeder skipped settled ones"


def test_a_service_stops_on_a_replaced_log_and_makes_nothing_on_the_new_broker(make_config, tmp_path, model_cache):
    """The broker goes away, then an empty one takes its place. While it is only away, a replica retries and does not
    take it for a lost log, and a replica stopped then exits in seconds (it does not wait for the broker's timeouts).
    On the empty one a running replica sends, commits and creates nothing (clients never make topics), and stops
    with LogReplaced once it sees the log's identity gone."""
    from services.launch.host import STOP_BROKER_S
    from services.runtime import LOG_CHECK_S
    from services.scorer import ScorerService
    from services.transport import LogReplaced
    from services.transport.brokers.local_broker import LocalBroker, free_port
    from services.transport.kafka import ANSWER_TIMEOUT_S

    port = free_port()
    settings = [f"kafka.bootstrap=127.0.0.1:{port}", "kafka.idempotent_producer=false"]
    config = make_config(*settings)
    broker = LocalBroker(port, log_path=tmp_path / "broker-1.log").start()
    stopped_by_signal = tmp_path / "scorer.log"
    command = streamppo_command(
        "-v", "scorer", overrides=[*run_settings(tmp_path, model_cache, 2, unique("away")), *settings]
    )
    with open(stopped_by_signal, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        runner = started(ScorerService(config, unique("scorer")), kafka_bus(config))
        runner.poll_once(0.2)
        deadline = time.monotonic() + 120
        while "serving rollouts" not in stopped_by_signal.read_text():
            assert time.monotonic() < deadline and process.poll() is None, stopped_by_signal.read_text()[-3000:]
            time.sleep(0.2)
        broker.stop()  # every record, offset and group is gone with it
        away = time.monotonic()
        while time.monotonic() < away + LOG_CHECK_S + ANSWER_TIMEOUT_S + 2:  # an identity check gets no answer
            try:
                runner.poll_once(0.2)
            except KafkaError:
                time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, stopped_by_signal.read_text()[-3000:]
        assert f"the broker did not answer within {STOP_BROKER_S:.0f} s of stopping" in stopped_by_signal.read_text()
        broker = LocalBroker(port, log_path=tmp_path / "broker-2.log").start()
        deadline, stopped = time.monotonic() + 60, None
        while stopped is None and time.monotonic() < deadline:
            try:
                runner.poll_once(0.2)
            except LogReplaced as exc:
                stopped = exc
            except KafkaError:
                time.sleep(0.5)  # as the process runner does: the broker is coming back
        assert stopped is not None and "is gone" in str(stopped), "the replica noticed within seconds"
        assert time.monotonic() - (deadline - 60) < 30 + LOG_CHECK_S
        runner.release_lost_log()
        runner.service.close()
        probe = KafkaBus(KafkaSettings(broker.bootstrap, idempotent_producer=False))._metadata_probe()
        assert probe.topics() == set(), "the old replica made no topic on the new broker"
        probe.close()
    finally:
        if process.poll() is None:
            process.kill()
        broker.stop()


@pytest.mark.slow
@pytest.mark.soak
def test_runs_on_one_broker_share_nothing_at_once_or_one_after_another(own_broker, tmp_path, model_cache):
    """Two runs at the same time on one broker, then a third after them: each in its own namespace (its run id), so
    no run consumes another's input, and each applies every version once."""
    steps = 3

    def run(name):
        folder = tmp_path / name
        folder.mkdir()
        run_id = unique(name)
        return (
            run_id,
            folder,
            *start_up(own_broker, folder, model_cache, steps, run_id, overrides=("data.eval_prompts=0",)),
        )

    def finished(run_id, folder, up, output, metrics):
        assert up.wait(timeout=600) == 0, output.read_text()[-3000:]
        records = [json.loads(line) for line in metrics.open()]
        assert [r["step"] for r in records] == list(range(1, steps + 1)), "every version applied exactly once"
        assert_each_group_once(records, run_id, steps)
        assert not re.search(r"skipping \w+ \S+ of run", output.read_text()), "no record of another run came here"

    together = [run("first"), run("second")]
    try:
        for started in together:
            finished(*started)
        finished(*run("after"))
    finally:
        for _, _, up, _, _ in together:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.soak
def test_chaos_random_kill_9_across_all_roles_applies_every_version_once(own_broker, tmp_path, model_cache):
    """`streamppo up` with two scorers and a streaming generator (records of 4 groups, updates of 8: half a prompt
    batch); ten `kill -9`s of random services while it runs; `up` restarts each. Every batch over 2 kB (nearly all)
    travels by reference, so its file must outlive every re-delivery. A learner killed after updates it had not
    checkpointed comes back at an older version while groups sampled by the rolled-back ones are on their way: they
    are trained (off-policy), and the generator takes the new lineage's weights (this stalled before)."""
    import random

    steps, run_id, kills = 40, unique("chaos"), 10
    prompt_batches = steps * 8 // 16  # updates × groups per update, in batches of 16 prompts
    up, output, metrics = start_up(
        own_broker,
        tmp_path,
        model_cache,
        steps,
        run_id,
        ("--replicas", "scorer=2"),
        (
            "pipeline.max_staleness=1",
            "learner.checkpoint_every=2",
            "pipeline.inline_max_bytes=2000",
            "kafka.retention.remove_committed_batches=true",  # files go at commit: kills must not strand them
            "generation.streaming=true",
            "generation.groups_per_record=4",
            "learner.groups_per_update=8",
        ),
    )
    # Every role dies at least once (the learner three times, a scorer twice), in a seeded order, at seeded moments.
    # A learner rolled back by a kill drops the groups that waited too long meanwhile; they are replaced, and the run
    # makes every update (it once ended at 39 of 40).
    chance, killed = random.Random(7), []
    roles = ["generator-0", "scorer-0", "scorer-1", "advantage-0", "learner-0"]
    extra = ["learner-0", "learner-0", "scorer-1"]
    victims = roles + extra + [chance.choice(roles) for _ in range(kills - len(roles) - len(extra))]
    chance.shuffle(victims)
    try:
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().strip()):  # the kills fall while it trains
            assert time.monotonic() < deadline and up.poll() is None, output.read_text()[-3000:]
            time.sleep(0.2)
        while len(killed) < kills and up.poll() is None and time.monotonic() < deadline:
            time.sleep(chance.uniform(1.5, 4.0))
            victim = victims[len(killed)]
            pattern = f"replica-id {victim} .*run.run_id={run_id}"
            if subprocess.run(["pkill", "-9", "-f", pattern]).returncode == 0:
                killed.append(victim)
        assert len(killed) == kills, f"only {killed} killed before the run ended; make it longer"
        try:
            assert up.wait(timeout=900) == 0, output.read_text()[-3000:]
        except subprocess.TimeoutExpired:  # a stall: what each replica holds and waits for says where
            status = subprocess.run(
                [sys.executable, "-m", "services.cli", "status", "--run-dir", str(tmp_path / "run")],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
            )
            pytest.fail(f"the run stalled after {killed}; streamppo status:\n{status.stdout}{status.stderr}")
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    text = output.read_text()
    assert text.count("with code -9; restarting it") == kills
    for victim in set(killed):  # `up` restarts whichever service died, after a pause it names
        assert re.search(rf"{victim} exited with code -9; restarting it in [0-9.]+ s", text), victim
    records = [json.loads(line) for line in metrics.open()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "every version applied exactly once"
    assert [r["policy_version"] for r in records] == [float(v) for v in range(1, steps + 1)], "no update lost"
    assert_each_group_once(records, run_id, prompt_batches)
    assert all(r["staleness_max"] <= 1 for r in records), "no group trained past max_staleness"
    # With remove_committed_batches a file goes once its record is committed past; a kill may orphan one (written,
    # never sent or removed).
    store = tmp_path / "run" / "batches"
    assert store.is_dir(), "batches went by reference (the store is made by the first one)"
    left = list(store.iterdir())
    assert len(left) <= 2 * kills, f"{len(left)} batch files left of ~{12 * steps}"


def learner_ranks(run_id: str) -> dict[int, int]:
    """rank → pid of the learner's rank processes of ``run_id`` (not their launcher)."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            command = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in command]
        if "services.cli" in words and "learner" in words and f"run.run_id={run_id}" in words:
            if "torch.distributed.run" in words:
                continue
            variables = dict(v.decode(errors="replace").partition("=")[::2] for v in environ if b"=" in v)
            if "RANK" in variables:
                ranks[int(variables["RANK"])] = int(entry)
    return ranks


@pytest.mark.slow
@pytest.mark.soak
def test_a_two_rank_learner_survives_kill_9_of_a_rank_and_applies_every_version_once(
    own_broker, make_config, tmp_path, model_cache
):
    """`streamppo up` with an FSDP learner of two ranks and two generator replicas that take the actor by broadcast;
    one rank is killed mid-run, then the other: `streamppo learner` restarts both from the sharded checkpoint each
    time, the generators join each new learner's broadcast group, and the run ends with each update once, reward
    up, and prompt batches shared by both generators."""
    kafka_broker = own_broker
    steps, run_id = 10, unique("ranks")
    up, output, metrics = start_up(
        kafka_broker,
        tmp_path,
        model_cache,
        steps,
        run_id,
        ("--replicas", "generator=2"),
        (
            "learner.parallel.strategy=fsdp",
            "learner.parallel.processes=2",
            "learner.checkpoint_every=2",
            f"weights.broadcast.address=127.0.0.1:{free_port()}",
            "weights.broadcast.receivers=2",
            "weights.broadcast.timeout_s=10",
        ),
        verbose=True,
    )
    killed = []
    try:
        deadline = time.monotonic() + 600
        for rank, after_updates in ((1, 3), (0, 6)):
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after_updates):
                assert time.monotonic() < deadline and up.poll() is None, output.read_text()[-3000:]
                time.sleep(0.2)
            pids = learner_ranks(run_id)
            assert sorted(pids) == [0, 1], f"two ranks run: {pids}"
            os.kill(pids[rank], signal.SIGKILL)
            killed.append(rank)
        assert up.wait(timeout=600) == 0, output.read_text()[-3000:]
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    text = output.read_text()
    # Each death in a line, and the ranks that saw it go in a line each: no tracebacks, no launcher report.
    assert "learner rank 1 ended: killed by SIGKILL" in text and "learner rank 0 ended: killed by SIGKILL" in text
    learner = [line for line in text.splitlines() if line.lstrip().startswith("learner-0 |")]
    assert not [line for line in learner if "Traceback" in line or "ChildFailedError" in line], "\n".join(learner)
    for generator in ("generator-0", "generator-1"):
        by_broadcast = re.findall(rf"{generator}: actor weights v(\d+) loaded from the broadcast", text)
        # From every learner the generators joined: before the first kill, between the kills, after the second.
        assert len(by_broadcast) >= 3, (generator, by_broadcast)
    records = [json.loads(line) for line in metrics.open()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "every version applied exactly once"
    assert_each_group_once(records, run_id, steps)
    rewards = [r["reward_mean"] for r in records]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.1, rewards
    rollouts = run_messages(make_config(*kafka_broker), "rollouts", run_id, steps)
    producers = {k: m.producer for k, m in rollouts.items()}
    assert set(producers.values()) == {"generator-0", "generator-1"}, "both generator replicas sampled"


def test_wait_says_what_it_waits_for_and_gives_up_at_its_timeout(kafka_broker, tmp_path, model_cache):
    """`streamppo wait` on a run no service has started: it names the missing log, and exits 1 at its timeout."""
    run_id = unique("never-started")
    args = streamppo_command(
        "wait", "--bootstrap", broker_address(kafka_broker), "--timeout", "3",
        overrides=[*run_settings(tmp_path, model_cache, 2, run_id), *kafka_broker],
    )  # fmt: skip
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"the log of run {run_id!r}" in result.stdout and "not done after 3 s" in result.stdout
