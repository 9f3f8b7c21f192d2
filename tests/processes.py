"""What the tests of processes over a real broker share (a pytest plugin of the suite, see conftest.py): the Kafka
config and bus of the suite's broker, `streamppo` commands and `up` runs in the background, and the run's messages
read back. A module with a bus of its own (the memory bus) overrides ``bus``."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import EXAMPLE, REPO
from helpers import assert_each_group_once, broker_address, run_settings

from common.schema import SchemaError, decode
from services.runtime.run_bus import kafka_bus


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


# Short sessions, as `up` gives the broker it starts: a killed replica's partitions move on in seconds.
KAFKA_SETTINGS = ("kafka.session_timeout_ms=1000", "kafka.heartbeat_interval_ms=250", "kafka.connect_timeout_s=180")


STREAMING = ("generation.streaming=true", "generation.groups_per_record=4", "learner.groups_per_update=8")


def command(*args: str, settings=()) -> list[str]:
    line = [sys.executable, "-m", "services.cli", "-v", *args, "--config", str(EXAMPLE / "config.yaml")]
    return line + [a for s in settings for a in ("--set", s)]


class Run:
    """`streamppo -v up` in the background on a broker the test owns, its output in a file, its metrics read."""

    def __init__(self, tmp_path: Path, model_cache, bootstrap: str, steps: int, *up_args, settings=()):
        self.tmp_path, self.steps, self.bootstrap = tmp_path, steps, bootstrap
        self.run_id = unique("kafka")
        self.settings = [
            *run_settings(tmp_path, model_cache, steps, self.run_id),
            "generation.backend=transformers",
            *KAFKA_SETTINGS,
            *settings,
        ]
        self.output = tmp_path / "up.log"
        self.metrics = tmp_path / "run" / "metrics.jsonl"
        with open(self.output, "w") as log:
            self.process = subprocess.Popen(
                command("up", "--bootstrap", bootstrap, *up_args, settings=self.settings),
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def updates(self) -> int:
        return len(self.metrics.read_text().splitlines()) if self.metrics.exists() else 0

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    def wait_updates(self, count: int, timeout_s: float = 300.0) -> float:
        """Wait until ``count`` updates are done; returns when (time.monotonic())."""
        deadline = time.monotonic() + timeout_s
        while self.updates() < count:
            assert time.monotonic() < deadline and self.process.poll() is None, self.log()[-4000:]
            time.sleep(0.1)
        return time.monotonic()

    def finish(self, timeout_s: float = 600.0) -> list[dict]:
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            status = subprocess.run(
                [sys.executable, "-m", "services.cli", "status", "--run-dir", str(self.tmp_path / "run")],
                cwd=REPO, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            pytest.fail(f"the run stalled; streamppo status:\n{status.stdout}{status.stderr}\n{self.log()[-3000:]}")
        assert code == 0, self.log()[-4000:]
        return [json.loads(line) for line in self.metrics.open()]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)

    def assert_every_version_and_group_once(self, records: list[dict]) -> None:
        assert [r["step"] for r in records] == list(range(1, self.steps + 1)), "every version applied exactly once"
        assert_each_group_once(records, self.run_id, self.steps * 8 // 16)
        text = self.log()
        assert "going on on the new log" not in text and "again in resume mode" not in text, "the log is the same one"
        assert "has given no partition" not in text, "the wedge workaround (the memory broker's group bug) never fired"


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
