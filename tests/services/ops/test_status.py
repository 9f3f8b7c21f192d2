"""`streamppo status` and `streamppo wait` (services/ops/status.py) against a real broker: what each replica waits for,
and a wait that gives up."""

import subprocess
import time

import pytest
from conftest import REPO
from helpers import (
    broker_address,
    run_settings,
    started_replica,
)
from processes import streamppo_command, unique

from services.runtime.run_bus import kafka_bus
from services.transport.kafka import KafkaBus, KafkaSettings

pytestmark = pytest.mark.slow  # services as processes and a broker per test where it needs one


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
