import os
from pathlib import Path

import pytest
from helpers import is_local_broker

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist each worker, and every process it starts, gets its share of the cores: torch's threads spin while
# they wait, and two workers that each run a thread per core made a 7 s test take two minutes.
# The fixtures and runs the tests of processes over a real broker share (tests/processes.py).
pytest_plugins = ["processes"]

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "vowels"


@pytest.hookimpl(tryfirst=True)  # before -m selects: `-m "not slow"` leaves every soak test out
def pytest_collection_modifyitems(config, items):
    """A soak test is slow by definition (pyproject.toml's markers). The slow tests first, in their order: with
    pytest-xdist (the README's `-n 2 --dist loadgroup`) the longest runs start at once on both workers instead of
    leaving one of them a long tail."""
    for item in items:
        if item.get_closest_marker("soak") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """A cache dir shared by the session's tests, and by its xdist workers (their base folders' parent is the
    session's), so that each builtin model is built once: SmolLM2's conversion takes ~20 s of a core."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "model-cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def tiny_model(model_cache) -> Path:
    from common.models import resolve_model

    return resolve_model("builtin:tiny-char-llama", model_cache)


@pytest.fixture
def make_config(tmp_path, model_cache):
    """The example config with a private run dir and the shared model cache, plus overrides.

    The generator samples with transformers unless a test asks for vLLM: an engine takes ~15 s to start, and
    the tests that are about vLLM live in test_vllm.py.
    """
    from common.config import load_config

    def make(*overrides: str, example: str = "config.yaml"):
        base = [f"run.dir={tmp_path / 'run'}", f"model.cache_dir={model_cache}", "generation.backend=transformers"]
        return load_config(EXAMPLE / example, base + list(overrides))

    return make


def sampled_experience(
    tiny_model, texts: list[str], max_new_tokens: int, seed: int, kl_scale: float = 0.0, temperature: float = 1.0
):
    """``2 × len(texts)`` responses of the tiny model at ``temperature``, as the learner gets them, with random
    advantages, values and scores (and KL estimates up to ``kl_scale``); returns the tokenizer and the
    :class:`Experience`."""
    import torch

    from common.generation import sample_responses
    from common.models import load_actor, load_tokenizer
    from common.sampling import SamplingParams
    from common.sequences import lengths_to_mask
    from services.learner.experience import Experience

    tokenizer = load_tokenizer(tiny_model)
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    prompt_lengths = enc["attention_mask"].sum(1)
    samples = sample_responses(
        load_actor(tiny_model),
        enc["input_ids"],
        prompt_lengths,
        SamplingParams(n=2, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed),
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    rows = samples.group_index
    mask = lengths_to_mask(samples.response_lengths, samples.response_tokens.shape[1])
    g = torch.Generator().manual_seed(0)
    advantages = torch.randn(mask.shape, generator=g) * mask
    values = torch.randn(mask.shape, generator=g) * mask
    return tokenizer, Experience(
        policy_versions=torch.zeros(len(rows), dtype=torch.int64),
        prompt_tokens=enc["input_ids"][rows],
        prompt_lengths=prompt_lengths[rows],
        response_tokens=samples.response_tokens,
        response_lengths=samples.response_lengths,
        finished=samples.finished,
        behaviour_logprobs=samples.behaviour_logprobs,
        scores=torch.randn(len(rows), generator=g),
        kl=torch.rand(mask.shape, generator=g) * kl_scale * mask,
        values=values,
        advantages=advantages,
        returns=advantages + values,
    )


@pytest.fixture(scope="session")
def experience(tiny_model):
    """8 responses of the tiny model to 4 prompts, as the learner gets them, with random advantages and values."""
    return sampled_experience(tiny_model, ["tell me about the cat.", "hi", "say something!", "the sea"], 10, seed=0)


# testcontainers' reaper runs in a container of its own, whose image comes from a registry; every container a test
# starts is stopped by the test itself.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
KAFKA_IMAGE = "confluentinc/cp-kafka:7.6.0"  # testcontainers' KafkaContainer (STREAMPPO_TEST_BROKER=container)
BROKERS = ("kafka", "local", "container")


def _suite_broker() -> str:
    """Which broker the suite runs against: ``env`` ($KAFKA_BOOTSTRAP_SERVERS), else $STREAMPPO_TEST_BROKER:
    ``kafka`` (the default: Apache Kafka from Maven Central's jars, started by the tests), ``local`` (the memory
    broker, tansu) or ``container`` (testcontainers' Kafka image, where a registry gives it)."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return "env"
    which = os.environ.get("STREAMPPO_TEST_BROKER", "kafka")
    if which not in BROKERS:
        raise pytest.UsageError(f"STREAMPPO_TEST_BROKER={which!r}: one of {', '.join(BROKERS)}")
    return which


def pytest_report_header(config):
    from helpers import docker_answers, image_available

    from services.transport.brokers.apache_kafka import KAFKA_VERSION

    broker = {
        "env": f"$KAFKA_BOOTSTRAP_SERVERS ({os.environ.get('KAFKA_BOOTSTRAP_SERVERS')})",
        "kafka": f"Apache Kafka {KAFKA_VERSION} (KRaft, from Maven Central's jars), one broker per test process",
        "local": "the local memory broker (tansu), one process per session (STREAMPPO_TEST_BROKER=local)",
        "container": f"Apache Kafka in a container ({KAFKA_IMAGE}, testcontainers)",
    }[_suite_broker()]
    images = [image for image in CONTAINER_IMAGES if image_available(image)]
    containers = (
        f"the images {', '.join(images)} on the Docker engine"
        if docker_answers() and len(images) == len(CONTAINER_IMAGES)
        else "skipped (no Docker engine, or images not built: deploy/docker/build.sh)"
    )
    selected = config.getoption("markexpr") or "every test"
    return [
        f"streamppo: broker: {broker}",
        f"streamppo: container tests: {containers}",
        f"streamppo: selected: {selected} (make test: not soak, not recipe; docs/testing.md)",
    ]


CONTAINER_IMAGES = ("streamppo:cpu", "streamppo-kafka:local", "streamppo-broker:local", "streamppo-prometheus:local")


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    """A real Kafka-protocol broker, as config overrides: the one :func:`_suite_broker` names. Apache Kafka by
    default; nothing is skipped where Java or the jars are missing: the tests fail, saying which (`make setup`)."""
    which = _suite_broker()
    if which == "env":
        yield [f"kafka.bootstrap={os.environ['KAFKA_BOOTSTRAP_SERVERS']}"]
    elif which == "kafka":
        from services.transport.brokers.apache_kafka import KafkaBroker, KafkaUnavailable

        try:
            broker = KafkaBroker(tmp_path_factory.mktemp("kafka")).start()
        except KafkaUnavailable as exc:
            pytest.fail(f"Apache Kafka cannot run here: {exc}", pytrace=False)
        try:
            yield [f"kafka.bootstrap={broker.bootstrap}"]
        finally:
            broker.stop()
    elif which == "container":
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer(KAFKA_IMAGE) as kafka:
            yield [f"kafka.bootstrap={kafka.get_bootstrap_server()}"]
    else:
        yield from _local_broker(tmp_path_factory.mktemp("broker") / "broker.log")


def _local_broker(log_path: Path):
    from services.transport.brokers.local_broker import LocalBroker

    with LocalBroker(log_path=log_path) as broker:
        yield [f"kafka.bootstrap={broker.bootstrap}", "kafka.idempotent_producer=false", "kafka.static_members=false"]


@pytest.fixture(scope="session")
def memory_broker(tmp_path_factory):
    """The local memory broker (tansu), the no-Java fallback of `streamppo up`: the transport contract runs on it
    too while it remains one."""
    yield from _local_broker(tmp_path_factory.mktemp("memory-broker") / "broker.log")


@pytest.fixture
def own_broker(kafka_broker, tmp_path):
    """A broker for this test alone when the session's is the local one (else the session's).

    For the tests that ``kill -9`` group members again and again, or run ``up`` after another run's groups (one per
    role) had other members: on the local broker (tansu) that had served the rest of the suite, a consumer group was
    seen to keep a restarted (or new) member without partitions for good (the run
    then waits for a batch no replica reads; ``streamppo status`` shows it). On a fresh local broker, and on
    Apache Kafka, it was not seen.
    """
    if not is_local_broker(kafka_broker):
        yield kafka_broker
        return
    yield from _local_broker(tmp_path / "own-broker.log")


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(kib)``: a real filesystem of that size (a tmpfs), for running out of space for real."""
    import subprocess

    mounted = []

    def mount(kib: int) -> Path:
        path = tmp_path / f"disk-{kib}k-{len(mounted)}"
        path.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)], capture_output=True, text=True
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
