"""Every service exports Prometheus metrics, and they move with the work done."""

import urllib.request

import pytest
from helpers import started

from common.schema import decode, encode
from services.feeder import FeederService
from services.generator import GeneratorService
from services.learner import LearnerService
from services.roles import pipeline_topics
from services.runtime.metrics import ServiceMetrics
from services.transport import MemoryBus
from services.transport.brokers.local_broker import free_port


def sample(metrics: ServiceMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.fixture
def config(make_config):
    return make_config(
        "data.batch_size=2", "generation.n=2", "generation.max_new_tokens=4", "learner.mini_batch_size=4"
    )


def generator_with_metrics(config):
    bus = MemoryBus()
    bus.create_topics(pipeline_topics())
    metrics = ServiceMetrics("generator")
    return bus, metrics, started(GeneratorService(config, "generator"), bus, metrics=metrics)


def test_counters_latency_lag_and_dead_letters_move(config):
    bus, metrics, runner = generator_with_metrics(config)
    feeder = FeederService(config)
    producer = bus.producer("test")
    for payload in (encode(feeder.batch(0)), b"junk", encode(feeder.batch(1))):
        producer.send("prompts", payload, key=b"k")
    runner.poll_once()
    assert sample(metrics, "streamppo_batches_total", role="generator", outcome="processed") == 1
    assert sample(metrics, "streamppo_sequences_total", role="generator") == 2  # the batch's 2 prompts
    (rollout,) = [decode(r.value) for r in bus.consumer("rollouts", None, "audit").poll(0, 10)]
    assert sample(metrics, "streamppo_tokens_total", role="generator") == rollout.response_lengths.sum() > 0
    assert sample(metrics, "streamppo_stage_seconds_count", role="generator") == 1
    assert sample(metrics, "streamppo_consumer_lag", role="generator") == 2
    runner.poll_once()
    assert sample(metrics, "streamppo_batches_total", role="generator", outcome="dead_letter") == 1


def test_learner_statistics_are_exported(config):
    metrics = ServiceMetrics("learner")
    learner = LearnerService(config)
    learner.observe(metrics.observe)
    learner.report({"reward_mean": 0.7, "kl": 0.01, "policy_version": 3, "staleness": 1})
    assert sample(metrics, "streamppo_learner_reward_mean") == 0.7
    assert sample(metrics, "streamppo_policy_version", role="learner") == 3
    assert sample(metrics, "streamppo_staleness", role="learner") == 1


def test_metrics_are_served_over_http():
    metrics = ServiceMetrics("scorer")
    metrics.count("processed", 8, 0.2)
    port = free_port()
    metrics.serve(port, address="127.0.0.1")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'streamppo_batches_total{outcome="processed",role="scorer"} 1.0' in body
    assert 'streamppo_stage_seconds_bucket{le="0.25",role="scorer"} 1.0' in body


def test_the_policy_version_gauge_follows_the_weights_actually_loaded(config):
    import torch

    bus, metrics, runner = generator_with_metrics(config)
    learner = LearnerService(config)
    learner.trainer.version = 1
    good = next(a for a in learner.announce() if a.model == "actor")
    with torch.no_grad():
        learner.trainer.actor.model.norm.weight.add_(1.0)
    learner.trainer.version = 2
    bad = next(a for a in learner.announce() if a.model == "actor")
    with open(bad.uri, "r+b") as fh:
        fh.seek(200)
        fh.write(b"\xff" * 8)
    producer = bus.producer("test")
    producer.send("weights", encode(good), key=b"actor")
    runner.poll_once()
    assert sample(metrics, "streamppo_policy_version", role="generator") == 1
    producer.send("weights", encode(bad), key=b"actor")
    runner.poll_once()
    assert sample(metrics, "streamppo_policy_version", role="generator") == 1, "a refused snapshot is not in use"


def test_a_port_range_takes_the_first_free_port():
    """Replicas on one host network share one command: each takes the next free port of the range."""
    import socket

    from services.runtime.metrics import parse_ports

    assert parse_ports("9100") == range(9100, 9101) and parse_ports("9110-9129") == range(9110, 9130)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first = taken.getsockname()[1]
        ports = range(first, first + 20)
        one, two = ServiceMetrics("scorer"), ServiceMetrics("scorer")
        a, b = one.serve_on_first_free(ports, "127.0.0.1"), two.serve_on_first_free(ports, "127.0.0.1")
    assert first < a < b, (first, a, b)
    assert "streamppo_batches" in urllib.request.urlopen(f"http://127.0.0.1:{b}/metrics").read().decode()
    with pytest.raises(OSError):
        ServiceMetrics("scorer").serve_on_first_free(range(a, a + 1), "127.0.0.1")


def test_a_scrape_target_file_is_what_prometheus_file_discovery_reads(tmp_path):
    import json

    from services.runtime.metrics import ScrapeTarget

    target = ScrapeTarget(tmp_path / "targets", "scorer-abc", "scorer", "127.0.0.1", 9111)
    assert json.loads(target.path.read_text()) == [
        {"targets": ["127.0.0.1:9111"], "labels": {"service": "scorer", "replica": "scorer-abc"}}
    ]
    assert [p.name for p in (tmp_path / "targets").iterdir()] == ["scorer-abc.json"], "no temporary file left"
    target.remove()
    assert not target.path.exists()


def test_a_replica_in_a_container_is_named_after_the_container(tmp_path):
    """On the host network every container has the host's name and its service is PID 1: the container's id names
    the replica (it survives the container's restarts); outside one, host and PID do."""
    from services.launch.host import _container_id

    cid = "5f09115f5931ca968e1eddbb3eb9e6627ccfe17a5f554682b1f96417dabfd2e6"
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"1021 1003 0:52 / / rw,relatime - overlay overlay rw\n"
        f"1040 1021 254:1 /var/lib/docker/containers/{cid}/hostname /etc/hostname rw,relatime - ext4 /dev/vda rw\n"
    )
    assert _container_id(str(mountinfo)) == cid
    mountinfo.write_text("22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n")
    assert _container_id(str(mountinfo)) is None
    assert _container_id(str(tmp_path / "missing")) is None
