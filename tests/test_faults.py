"""Faults caused for real, against a real broker: services killed, stopped and restarted, garbage injected."""

import json
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import EXAMPLE, REPO
from helpers import assert_each_group_once, run_settings

from common.schema import decode
from services.launch.cluster import stop_all
from services.transport.run_bus import kafka_bus

pytestmark = pytest.mark.slow


class Cluster:
    """Each service as its own process, as `streamppo <role>` would run it in production."""

    def __init__(self, tmp_path, overrides):
        self.tmp_path, self.overrides = tmp_path, overrides
        self.processes: dict[str, subprocess.Popen] = {}
        self.killed: set[str] = set()
        self.metrics = tmp_path / "run" / "metrics.jsonl"

    def start(self, name, role, *extra_args):
        self.killed.discard(name)
        args = [
            sys.executable,
            "-m",
            "services.cli",
            "-v",
            role,
            "--config",
            str(EXAMPLE / "config.yaml"),
            *[a for o in self.overrides for a in ("--set", o)],
            *extra_args,
        ]
        if role != "feed":
            args += ["--replica-id", name]
        log = open(self.tmp_path / f"{name}.log", "a")
        self.processes[name] = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def steps(self) -> list[dict]:
        if not self.metrics.exists():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines()]

    def wait_for_steps(self, count, timeout_s=300):
        deadline = time.monotonic() + timeout_s
        while len(self.steps()) < count:
            assert time.monotonic() < deadline, f"stuck at {len(self.steps())} steps; logs in {self.tmp_path}"
            crashed = [n for n, p in self.processes.items() if p.poll() not in (None, 0) and n not in self.killed]
            assert not crashed, f"{crashed} crashed; logs in {self.tmp_path}"
            time.sleep(0.2)
        return time.monotonic()

    def stop(self, name, sig=signal.SIGTERM, timeout_s=120) -> int:
        self.killed.add(name)
        self.processes[name].send_signal(sig)
        return self.processes[name].wait(timeout=timeout_s)

    def close(self):
        stop_all(list(self.processes.values()))


@pytest.fixture
def cluster(tmp_path, model_cache, kafka_broker):
    def make(steps, *more_overrides):
        run_id = f"f{uuid.uuid4().hex[:8]}"
        # Faults of the transport and the learner: the generator samples with transformers (no engine start per
        # restart); test_kafka runs the processes with the vLLM generator.
        overrides = [
            *run_settings(tmp_path, model_cache, steps, run_id),
            "generation.backend=transformers",
            *kafka_broker,
            *more_overrides,
        ]
        made = Cluster(tmp_path, overrides)
        made.run_id = run_id
        return made

    made = []
    yield lambda steps, *more: made.append(make(steps, *more)) or made[-1]
    for c in made:
        c.close()


def assert_each_batch_once(cluster, steps):
    assert_each_group_once(cluster.steps(), cluster.run_id, steps)


def scrape_and_check_metrics(ports: dict[str, int]) -> None:
    """Scrape /metrics of each service while it works: every documented series is there and counts."""
    import urllib.request

    from common.statistics import gauges

    for role, port in ports.items():
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

        def value(series: str, body: str = body) -> float:
            return float(re.search(re.escape(series) + r" ([0-9.e+-]+)", body).group(1))

        assert value(f'streamppo_batches_total{{outcome="processed",role="{role}"}}') >= 2, role
        assert value(f'streamppo_sequences_total{{role="{role}"}}') > 0, role
        assert value(f'streamppo_tokens_total{{role="{role}"}}') > 0, role
        assert value(f'streamppo_stage_seconds_count{{role="{role}"}}') >= 2, role
        assert f'streamppo_consumer_lag{{role="{role}"}}' in body, role
        if role in ("generator", "advantage", "learner"):  # the roles that hold weights
            assert value(f'streamppo_policy_version{{role="{role}"}}') >= 1, role
        if role == "learner":
            for stat in gauges():
                assert f"streamppo_learner_{stat} " in body, stat
            assert 'streamppo_staleness{role="learner"}' in body


def test_sigterm_and_restart_of_every_service_loses_nothing(cluster, make_config, kafka_broker):
    """Each service in turn stopped by SIGTERM and started again, garbage on every topic, and (before the first
    stop) every service's Prometheus metrics scraped while it works. Kills (kill -9) of every role are the chaos
    test's (test_kafka.py)."""
    from services.transport.local_broker import free_port

    steps = 10
    c = cluster(steps)
    bus = kafka_bus(make_config(*c.overrides))
    garbage = {
        topic: b"\xc1garbage-" + uuid.uuid4().bytes
        for topic in ("prompts", "rollouts", "scored", "experience", "weights")
    }
    producer = bus.producer("saboteur")
    for topic, payload in garbage.items():
        producer.send(topic, payload, key=b"saboteur")  # Apache Kafka refuses a keyless record on compacted weights
    producer.flush()
    ports = {role: free_port() for role in ("generator", "scorer", "advantage", "learner")}
    for role, port in ports.items():
        c.start(role, role, "--metrics-port", str(port))
    c.start("feed", "feed")
    for after, roles in ((2, ("generator", "scorer")), (6, ("advantage", "learner"))):
        c.wait_for_steps(after)
        if after == 2:
            scrape_and_check_metrics(ports)
        for role in roles:  # two at a time: each restart stalls the pipeline while its process starts
            assert c.stop(role) == 0, f"{role} must exit 0 on SIGTERM"
            c.start(role, role)
    assert c.processes["learner"].wait(timeout=300) == 0
    assert_each_batch_once(c, steps)
    resumed = re.search(r"resumed from checkpoint at v(\d+)", (c.tmp_path / "learner.log").read_text())
    assert resumed and int(resumed.group(1)) >= 6
    # Each malformed record landed in its topic's dead-letter topic, and the pipeline went on regardless.
    for topic, payload in garbage.items():
        dlq = bus.consumer(f"{topic}.dlq", None, f"audit-{topic}")
        letters, deadline = [], time.monotonic() + 30
        while not letters and time.monotonic() < deadline:
            letters = [decode(r.value) for r in dlq.poll(0.5, 1000) if r.value and decode(r.value).payload == payload]
        assert letters, f"the garbage sent to {topic} is not in {topic}.dlq"


def test_environment_replicas_and_a_generator_killed_mid_episode_lose_no_episode(cluster, make_config):
    """Multi-turn episodes over the broker with two environment replicas; one is killed (kill -9) once it has
    answered turns. Its unanswered turns go to the other, which makes their episodes' environments again from the
    turns they carry; none waits out its turn timeout. Then the generator is killed with episodes in flight and
    started again: its prompt batches come again and their episodes start again from the prompt, the answers meant
    for the dead process ignored. Every episode is trained once."""
    steps = 6
    c = cluster(
        steps,
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=12",
        "generation.streaming=true",
        "learner.mini_batch_size=4",
        "environment.name=tests.test_episodes:Counter",
        "environment.max_turns=3",
        "environment.turn_timeout_s=120",
    )
    bus = kafka_bus(make_config(*c.overrides))
    for role in ("generator", "scorer", "advantage", "learner"):
        c.start(role, role)
    for name in ("environment-0", "environment-1"):
        c.start(name, "environment")
    c.start("feed", "feed")
    replies, reader = [], None
    deadline = time.monotonic() + 300
    while not any(reply.producer == "environment-0" for reply in replies):
        assert time.monotonic() < deadline, f"environment-0 answered nothing; logs in {c.tmp_path}"
        reader = reader or bus.consumer("observations", None, "audit")  # once the run made the topic
        replies += [decode(record.value) for record in reader.poll(0.5, 1000)]
    c.stop("environment-0", signal.SIGKILL)
    killed_at = time.time()
    c.wait_for_steps(2)
    c.stop("generator", signal.SIGKILL)  # with episodes in flight: the feeder published every batch at once
    c.start("generator", "generator")
    c.wait_for_steps(steps)
    assert c.processes["learner"].wait(timeout=300) == 0
    assert_each_batch_once(c, steps)
    while records := reader.poll(2.0, 1000):
        replies += [decode(record.value) for record in records]
    assert any(r.producer == "environment-1" and r.created_at > killed_at for r in replies), "no answer after the kill"
    generator_log = (c.tmp_path / "generator.log").read_text()
    assert "no answer from the environment" not in generator_log, "an episode waited out its timeout"
    # Turns of the killed generator's episodes were asked by two processes: each answer went to its own.
    assert len({r.reply_to for r in replies}) == 2
    episodes = {(r.episode, r.turn) for r in replies}
    assert {r.episode for r in replies if r.turn > 0}, "no episode had a second turn: the test shows nothing"
    assert episodes, "no turn was answered"
