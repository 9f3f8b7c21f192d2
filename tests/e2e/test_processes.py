"""The services as processes (`streamppo up`, a role's command, `streamppo topics`) against a real broker started by
the tests."""

import importlib.util
import json
import signal
import subprocess
import sys
import time

import pytest
from conftest import EXAMPLE, REPO
from helpers import (
    assert_each_group_once,
    run_settings,
    started,
)
from kafka.errors import KafkaError
from processes import archived_and_traced, run_messages, run_up, streamppo_command, unique

from services.runtime.run_bus import kafka_bus
from services.transport import TopicSpec
from services.transport.brokers.local_broker import free_port
from services.transport.kafka import KafkaBus, KafkaSettings

pytestmark = pytest.mark.slow  # services as processes and a broker per test where it needs one


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
            answer = admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, f"vowels.{t}") for t in topics], config_filter="all"
            )["topic"]
            kept = {name.removeprefix("vowels."): {k: c["value"] for k, c in cs.items()} for name, cs in answer.items()}
        finally:
            admin.close()
        assert kept["experience"]["retention.ms"] == kept["experience.dlq"]["retention.ms"] == str(2 * 3_600_000)
        assert kept["experience"]["retention.bytes"] == "1000000"
        assert kept["prompts"]["retention.ms"] == str(168 * 3_600_000)
        assert kept["weights"]["cleanup.policy"] == "compact"


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


def test_a_service_stops_on_a_replaced_log_and_makes_nothing_on_the_new_broker(make_config, tmp_path, model_cache):
    """The broker goes away, then an empty one takes its place. While it is only away, a replica retries and does not
    take it for a lost log, and a replica stopped then exits in seconds (it does not wait for the broker's timeouts).
    On the empty one a running replica sends, commits and creates nothing (clients never make topics), and stops
    with LogReplaced once it sees the log's identity gone."""
    from services.launch.host import STOP_BROKER_S
    from services.runtime import LOG_CHECK_S
    from services.scorer import ScorerService
    from services.transport import LogReplaced
    from services.transport.brokers.local_broker import LocalBroker
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
