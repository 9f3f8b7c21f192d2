"""The images and the compose file, for real: the services as containers on a Docker engine, through testcontainers.

Needs a Docker engine and the images that ``deploy/docker/build.sh`` builds (the README's test command starts an
engine and builds them when it runs as root); skipped without them, except under CI, where they must be there. Every
container runs on the host network (traffic stays on 127.0.0.1), as the compose file says.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import subprocess
import time
import urllib.request
import uuid

import pytest
from conftest import CONTAINER_IMAGES, REPO
from helpers import assert_each_group_once, docker_answers, image_available

from services.transport.brokers.local_broker import free_port

COMPOSE = REPO / "deploy" / "compose"
FILES = ["docker-compose.yml", "docker-compose.local.yml"]  # the local broker image: no registry to pull Kafka from
LEARNER_METRICS = "http://127.0.0.1:9160/metrics"  # the learner's port in the compose file

pytestmark = [pytest.mark.slow, pytest.mark.containers, pytest.mark.xdist_group("containers")]


@pytest.fixture(scope="module", autouse=True)
def images():
    missing = [image for image in CONTAINER_IMAGES if not image_available(image)]
    if docker_answers() and not missing:
        return
    why = "no Docker engine answers" if not docker_answers() else f"images not built: {', '.join(missing)}"
    if os.environ.get("CI"):
        pytest.fail(f"{why} (the test command starts an engine and runs deploy/docker/build.sh as root)")
    pytest.skip(f"{why}: deploy/docker/engine.sh start && deploy/docker/build.sh")


def _get(url: str, timeout_s: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def _learner_version() -> float:
    """The learner's policy version, from its /metrics (0 until it serves)."""
    try:
        text = _get(LEARNER_METRICS)
    except OSError:
        return 0.0
    found = re.search(r'^streamppo_policy_version\{role="learner"\} ([0-9.]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _until(condition, what: str, timeout_s: float, every_s: float = 1.0, explain=lambda: ""):
    """Wait for ``condition``; on time out fail with ``what`` and whatever ``explain()`` says of the containers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(every_s)
    pytest.fail(f"not within {timeout_s:.0f} s: {what}\n{explain()}")


def _metrics_in(ports: range, *needles: str) -> str:
    """The first /metrics page in ``ports`` that holds every needle, or "": a replica takes the first free port of its
    range, so another process on the host can move it off the first one."""
    for port in ports:
        try:
            text = _get(f"http://127.0.0.1:{port}/metrics", timeout_s=1.0)
        except OSError:
            continue
        if all(needle in text for needle in needles):
            return text
    return ""


def _scrape_targets(prometheus_port: int) -> list[tuple[str, str]]:
    """(service, health) of every target Prometheus scrapes."""
    targets = json.loads(_get(f"http://127.0.0.1:{prometheus_port}/api/v1/targets"))["data"]["activeTargets"]
    return sorted((t["labels"].get("service", "?"), t["health"]) for t in targets)


@contextlib.contextmanager
def _explained_on_failure(compose):
    """``with compose:``, where a failed `up` fails the test with what each container that exited said (a broker that
    exits at start is otherwise only "dependency failed to start: container ...-kafka-1 exited (1)")."""

    def compose_says(*args: str) -> str:
        command = [*compose.compose_command_property, *args]
        return subprocess.run(command, capture_output=True, text=True, cwd=COMPOSE).stdout

    try:
        compose.start()
    except subprocess.CalledProcessError as failed:
        listed = compose_says("ps", "-a", "--format", "{{.Service}} {{.State}}").splitlines()
        exited = sorted({line.split()[0] for line in listed if line.endswith("exited")})
        said = [
            f"{service}'s log:\n{compose_says('logs', '--no-log-prefix', '--tail', '20', service)}"
            for service in exited
        ]
        compose.stop()
        pytest.fail(f"`docker compose up` failed: {failed.stderr.decode(errors='replace')[-2000:]}\n" + "\n".join(said))
    try:
        yield compose
    finally:
        compose.stop()


def test_compose_trains_vowels_with_three_scorers_through_a_restart_and_a_kill(monkeypatch, tmp_path):
    """`docker compose up` of deploy/compose (with the local override: Apache Kafka from the streamppo-kafka image)
    and `--scale scorer=3`: Prometheus finds and scrapes all six service replicas; `docker compose restart learner`
    mid-run, then `docker kill` of Kafka's container (started again on its volume), then of a random service
    container (started again, as an operator would: Docker's restart policy leaves a killed container down); `docker
    compose run --rm wait` follows the run to its end and prints its summary. From the learner's metrics in the
    shared volume: every version applied exactly once, every group trained once; from the containers' logs: the
    services went on on the same log after Kafka's kill (no new-log recovery)."""
    from testcontainers.compose import DockerCompose

    steps, prometheus_port = 12, free_port()
    project = f"streamppo-test-{uuid.uuid4().hex[:6]}"
    for name, value in {
        "COMPOSE_PROJECT_NAME": project,
        "SCORER_REPLICAS": "3",
        "KAFKA_PORT": str(free_port()),
        "KAFKA_CONTROLLER_PORT": str(free_port()),  # not KAFKA_PORT + 1, which another process may hold
        "PROMETHEUS_PORT": str(prometheus_port),
        # a short run that checkpoints often, so that the restart and the kill each roll the learner back
        "STREAMPPO_SET": f"run.steps={steps} learner.checkpoint_every=3",
    }.items():
        monkeypatch.setenv(name, value)
    compose = DockerCompose(COMPOSE, compose_file_name=FILES, wait=False)  # `up --detach`
    command = compose.compose_command_property
    with _explained_on_failure(compose):
        containers = {c.Service: c for c in compose.get_containers()}
        assert sum(c.Service == "scorer" for c in compose.get_containers()) == 3
        _until(lambda: _learner_version() >= 2, "the learner's version 2", timeout_s=600)
        expected = [("advantage", "up"), ("generator", "up"), ("learner", "up")] + [("scorer", "up")] * 3
        _until(lambda: _scrape_targets(prometheus_port) == expected, f"scrape targets {expected}", timeout_s=60)

        subprocess.run([*command, "restart", "learner"], check=True, capture_output=True, timeout=120)
        _until(lambda: _learner_version() >= 6, "the learner's version 6 after its restart", timeout_s=600)

        # Apache Kafka's container killed mid-run and started again: its log is on the kafka-data volume.
        at = _learner_version()
        subprocess.run(["docker", "kill", containers["kafka"].ID], check=True, capture_output=True)
        time.sleep(2)
        subprocess.run(["docker", "start", containers["kafka"].ID], check=True, capture_output=True)
        _until(lambda: _learner_version() >= at + 2, "two more versions after Kafka's restart", timeout_s=600)

        services = [c for c in compose.get_containers() if c.Service in ("generator", "scorer", "advantage", "learner")]
        victim = random.Random(project).choice(services)
        subprocess.run(["docker", "kill", victim.ID], check=True, capture_output=True)
        subprocess.run(["docker", "start", victim.ID], check=True, capture_output=True)

        waited = subprocess.run(
            [*command, "run", "--rm", "wait"], capture_output=True, text=True, timeout=900, cwd=COMPOSE
        )
        assert waited.returncode == 0, waited.stdout[-3000:] + waited.stderr[-3000:]
        assert f"done: {steps} steps" in waited.stdout, waited.stdout[-2000:]
        assert "dead letters 0" in waited.stdout
        said = subprocess.run([*command, "logs", "--no-color"], capture_output=True, text=True, cwd=COMPOSE).stdout
        assert "the log it worked on" not in said and "going on on the new log" not in said, "the log is the same one"
        assert "has given no partition" not in said, "the wedge workaround (the memory broker's group bug) never fired"
        out = tmp_path / "metrics.jsonl"
        subprocess.run(["docker", "cp", f"{containers['learner'].ID}:/shared/run/metrics.jsonl", str(out)], check=True)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "every version applied exactly once"
    assert [r["policy_version"] for r in records] == [float(v) for v in range(1, steps + 1)], "no update lost"
    assert_each_group_once(records, "compose-vowels", steps)  # one prompt batch per update
    print(f"killed {victim.Service} ({victim.Name})")


@pytest.mark.soak
@pytest.mark.parametrize("image", ["streamppo-kafka:local", "streamppo-broker:local"])
def test_the_broker_images_serve_a_run_of_processes(tmp_path, model_cache, image):
    """Each broker image in a container (testcontainers' DockerContainer, host network, a free port): Apache Kafka's,
    ready once it answers an ApiVersions request, and the memory broker's, once it answers on its port; `streamppo
    up` over it trains every version once."""
    from processes import run_up, unique
    from testcontainers.core.container import DockerContainer

    from services.transport.brokers.apache_kafka import _answers as kafka_answers

    port, steps, run_id = free_port(), 4, unique("broker-image")
    url = f"tcp://127.0.0.1:{port}"
    broker = DockerContainer(image).with_kwargs(network_mode="host")
    if image.startswith("streamppo-kafka"):
        broker = broker.with_env("KAFKA_PORT", str(port)).with_env("KAFKA_CONTROLLER_PORT", str(free_port()))
    else:
        broker = broker.with_env("LISTENER_URL", url).with_env("ADVERTISED_LISTENER_URL", url)
    ready = kafka_answers if image.startswith("streamppo-kafka") else _answers
    with broker:
        _until(lambda: ready(port), f"the broker container on 127.0.0.1:{port}", timeout_s=120, every_s=0.2)
        overrides = [f"kafka.bootstrap=127.0.0.1:{port}"]
        if not image.startswith("streamppo-kafka"):
            overrides.append("kafka.idempotent_producer=false")
        run_up(overrides, tmp_path, model_cache, steps, run_id)
        container = broker.get_wrapped_container()
        container.reload()
        assert container.status == "running", "the run went through the container, which still serves"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))


def _answers(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


FLEET_FILES = [*FILES, "docker-compose.fleet.yml"]
FLEET_RUNS = {"run-a": "fleet-run-a", "run-b": "fleet-run-b"}  # deploy/compose/fleet-runs/: file -> run id


@pytest.mark.soak
def test_compose_fleet_serves_two_runs_through_a_kill_of_its_generator(monkeypatch, tmp_path):
    """deploy/compose's fleet: one project with the broker and a generator, scorer and advantage replica serving every
    run in deploy/compose/fleet-runs/ (two LoRA runs on one base), and a project per run with its learner and feeder.
    Mid-run the generator fleet's container is killed and started again. Each run's `wait` ends with its summary;
    each run applied every version and trained every group exactly once; the generator fleet's /metrics gave each
    run's share, and its one vLLM engine served both runs' adapters."""
    steps, prometheus_port = 8, free_port()
    project = f"streamppo-fleet-{uuid.uuid4().hex[:6]}"
    for name, value in {
        "KAFKA_PORT": str(free_port()),
        "KAFKA_CONTROLLER_PORT": str(free_port()),
        "PROMETHEUS_PORT": str(prometheus_port),
        "FLEET_VOLUME": f"{project}-shared",
        "STREAMPPO_SET": f"run.steps={steps} learner.checkpoint_every=2",
    }.items():
        monkeypatch.setenv(name, value)
    compose = ["docker", "compose", *[a for f in FLEET_FILES for a in ("-f", str(COMPOSE / f))]]

    def in_project(name, *args, run=None, timeout=300):
        """``docker compose`` in the fleet's project, or (``run``) in a run's, its profile on."""
        env = {**os.environ, **({"RUN": run, "COMPOSE_PROFILES": "run"} if run else {})}
        return subprocess.run(
            [*compose, "-p", name, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=COMPOSE
        )

    def container(name, service):
        found = in_project(name, "ps", "-a", "-q", service).stdout.split()  # a learner that is done has exited
        assert found, f"no {service} container in {name}"
        return found[0]

    try:
        started = in_project(project, "up", "-d")
        assert started.returncode == 0, started.stderr[-3000:]
        for run in FLEET_RUNS:
            started = in_project(f"{project}-{run}", "up", "-d", "--no-deps", "learner", "feed", run=run)
            assert started.returncode == 0, started.stderr[-3000:]

        def fleet_metrics() -> str:  # the generator fleet's range in the compose file
            return _metrics_in(range(9100, 9110), *(f'role="generator",run="{r}"' for r in FLEET_RUNS.values()))

        def generator_state() -> str:
            listed = subprocess.run(["docker", "ps", "-a"], capture_output=True, text=True).stdout
            logs = subprocess.run(
                ["docker", "logs", "--tail", "40", container(project, "generator")], capture_output=True, text=True
            )
            return f"docker ps -a:\n{listed}\ngenerator's log:\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}"

        def both_served(text):
            return all(
                f'streamppo_fleet_share_fraction{{role="generator",run="{r}"}} 0.5' in text for r in FLEET_RUNS.values()
            )

        def versions(text, at_least):
            found = re.findall(r'^streamppo_policy_version\{role="generator",run="([^"]+)"\} ([0-9.]+)$', text, re.M)
            return len([run for run, v in found if float(v) >= at_least]) == len(FLEET_RUNS)

        _until(
            lambda: both_served(fleet_metrics()), "the generator fleet serving both runs", 600, explain=generator_state
        )
        _until(
            lambda: versions(fleet_metrics(), 2),
            "both adapters at version 2 in the generator",
            600,
            explain=generator_state,
        )
        generator = container(project, "generator")
        subprocess.run(["docker", "kill", generator], check=True, capture_output=True)
        subprocess.run(["docker", "start", generator], check=True, capture_output=True)

        summaries = {}
        for run in FLEET_RUNS:
            waited = in_project(f"{project}-{run}", "run", "--rm", "--no-deps", "wait", run=run, timeout=900)
            assert waited.returncode == 0, waited.stdout[-3000:] + waited.stderr[-3000:]
            summaries[run] = waited.stdout
            out = tmp_path / f"{run}.jsonl"
            learner = container(f"{project}-{run}", "learner")
            subprocess.run(["docker", "cp", f"{learner}:/shared/{run}/run/metrics.jsonl", str(out)], check=True)
        logs = subprocess.run(["docker", "logs", generator], capture_output=True, text=True)
        generator_log = logs.stdout + logs.stderr
    finally:  # the runs' containers, then the fleet's project and the volume they shared, then the runs' volumes
        for run in FLEET_RUNS:
            in_project(f"{project}-{run}", "down", "--timeout", "20", run=run)
        in_project(project, "down", "-v", "--timeout", "20")
        for run in FLEET_RUNS:
            in_project(f"{project}-{run}", "down", "-v", run=run)
    for run, run_id in FLEET_RUNS.items():
        assert f"done: {steps} steps" in summaries[run] and "dead letters 0" in summaries[run], summaries[run][-2000:]
        records = [json.loads(line) for line in (tmp_path / f"{run}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, steps + 1)), f"{run}: every version applied exactly once"
        assert_each_group_once(records, run_id, steps)
    assert "on the vLLM engine of" in generator_log and "(2 runs)" in generator_log, "one engine, an adapter a run"
