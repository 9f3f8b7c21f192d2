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
from services.runtime.run_bus import kafka_bus

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


class Saboteur:
    """Any client of the broker, writing with kafka-python itself what the project's producers never would: null
    values (tombstones on the compacted topics), empty values, null keys, headers of any shape, a value as large as
    a record of the topic may be."""

    DATA_TOPICS = ("prompts", "rollouts", "scored", "experience")

    def __init__(self, config):
        from kafka import KafkaProducer

        self.namespace, self.limit = config.namespace, config.kafka.max_message_bytes
        self.producer = KafkaProducer(
            bootstrap_servers=config.kafka.bootstrap, max_request_size=self.limit + (1 << 20), acks="all"
        )
        self.written: list[tuple[str, int, int, bytes | None]] = []  # topic, partition, offset, value

    def shapes(self) -> list[tuple[bytes | None, bytes | None, list]]:
        """(value, key, headers) of each shape."""
        headers = [("", b""), ("h", b"\xff"), ("\u00fc\u2603", b"\x00" * 300), ("h", b"twice")]
        return [
            (None, b"x", []),  # (kafka-python writes no record whose key and value are both null)
            (b"", b"x", []),
            (b"\xc1garbage-" + uuid.uuid4().bytes, None, headers),
            (b"\x81\xa6schema\xa7prompts", b"k" * 4096, headers),  # a schema's name and nothing else
            (b"\xc1" * (self.limit - 4096), b"x", []),  # as large as the topic's max.message.bytes allows
        ]

    def write(self) -> None:
        futures = []
        for topic in self.DATA_TOPICS:
            for value, key, headers in self.shapes():
                futures.append((topic, value, self.producer.send(f"{self.namespace}.{topic}", value, key, headers)))
        for topic, key in (("weights", b"actor"), ("status", b"learner-0"), ("log-identity", b"forged")):
            futures.append((topic, None, self.producer.send(f"{self.namespace}.{topic}", None, key)))  # tombstones
        for topic, value, future in futures:
            sent = future.get(timeout=60)
            self.written.append((topic, sent.partition, sent.offset, value))

    def assert_dead_lettered(self, bus) -> None:
        """Every record written to a data topic is on its dead-letter topic, with what came in (or its start)."""
        for topic in self.DATA_TOPICS:
            expected = {(p, o): v for t, p, o, v in self.written if t == topic}
            dlq, letters, deadline = bus.consumer(f"{topic}.dlq", None, f"audit-{topic}"), {}, time.monotonic() + 60
            while set(expected) - set(letters) and time.monotonic() < deadline:
                for record in dlq.poll(0.5, 1000):
                    letter = decode(record.value)
                    if letter.source_topic == topic:
                        letters[(letter.source_partition, letter.source_offset)] = letter
            for where, value in expected.items():
                assert where in letters, f"{topic}{list(where)} is not on {topic}.dlq"
                payload = letters[where].payload
                if value is None or len(value) < self.limit // 2:
                    assert payload == (value or b""), (topic, where)
                else:  # cut to what a record holds beside the letter's other fields
                    assert value.startswith(payload) and len(payload) > self.limit // 2, (topic, where)

    def close(self) -> None:
        self.producer.close()


def test_sigterm_and_restart_of_every_service_loses_nothing_and_no_record_a_client_writes_stops_one(
    cluster, make_config, kafka_broker
):
    """Each service in turn stopped by SIGTERM and started again; before the services start and again while they
    work, records of every shape any client can write on every topic (:class:`Saboteur`); and (before the first
    stop) every service's Prometheus metrics scraped while it works. Kills (kill -9) of every role are the chaos
    test's (test_kafka.py)."""
    from services.transport.brokers.local_broker import free_port

    steps = 10
    c = cluster(steps, f"kafka.max_message_bytes={2 << 20}")
    config = make_config(*c.overrides)
    bus = kafka_bus(config)
    saboteur = Saboteur(config)
    saboteur.write()
    ports = {role: free_port() for role in ("generator", "scorer", "advantage", "learner")}
    for role, port in ports.items():
        c.start(role, role, "--metrics-port", str(port))
    c.start("feed", "feed")
    for after, roles in ((2, ("generator", "scorer")), (6, ("advantage", "learner"))):
        c.wait_for_steps(after)
        if after == 2:
            scrape_and_check_metrics(ports)
            saboteur.write()  # read by the replicas as they work
        for role in roles:  # two at a time: each restart stalls the pipeline while its process starts
            assert c.stop(role) == 0, f"{role} must exit 0 on SIGTERM"
            c.start(role, role)
    assert c.processes["learner"].wait(timeout=300) == 0
    assert_each_batch_once(c, steps)
    resumed = re.search(r"resumed from checkpoint at v(\d+)", (c.tmp_path / "learner.log").read_text())
    assert resumed and int(resumed.group(1)) >= 6
    saboteur.assert_dead_lettered(bus)
    saboteur.close()
    generator_log = (c.tmp_path / "generator.log").read_text()
    assert re.search(r"weights\[0\]@\d+ is a tombstone", generator_log), "the weights tombstone, taken as one"


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
        "environment.name=tests.services.environment.test_episodes:Counter",
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
