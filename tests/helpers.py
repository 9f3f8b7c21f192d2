"""Helpers the test modules share: reading and writing a bus's topics, the test broker's overrides."""

import functools
import subprocess
from pathlib import Path

from common.schema import decode


def read_all(bus, topic) -> list[bytes]:
    """Every record's value on ``topic`` of the in-memory bus, from the beginning."""
    return [r.value for r in bus.consumer(topic, None, "reader").poll(0.0, max_records=1000)]


def read_messages(bus, topic) -> list:
    """Every message on ``topic`` of the in-memory bus, decoded."""
    return [decode(value) for value in read_all(bus, topic)]


def publish(bus, topic, *payloads, key=b"k", partition=None):
    """Raw payloads onto ``topic``."""
    producer = bus.producer("test")
    for payload in payloads:
        producer.send(topic, payload, key=key, partition=partition)
    producer.flush()


def run_settings(tmp_path, model_cache, steps: int, run_id: str) -> list[str]:
    """The overrides of a test's run of ``steps`` under ``tmp_path/run``, with the session's model cache."""
    return [
        f"run.steps={steps}",
        f"run.dir={tmp_path / 'run'}",
        f"run.run_id={run_id}",
        f"model.cache_dir={model_cache}",
    ]


def broker_address(kafka_broker: list[str]) -> str:
    """The bootstrap address in the ``kafka_broker`` fixture's overrides."""
    return next(o for o in kafka_broker if o.startswith("kafka.bootstrap=")).split("=", 1)[1]


def is_local_broker(kafka_broker: list[str]) -> bool:
    """Whether the ``kafka_broker`` fixture's broker is the local one (tansu): its overrides turn idempotence off."""
    return "kafka.idempotent_producer=false" in kafka_broker


def assert_each_group_once(records: list[dict], run_id: str, prompt_batches: int) -> None:
    """From the learner's metrics lines: every group of prompt batches ``0 .. prompt_batches−1`` trained exactly
    once (each batch whole), and nothing else. Where groups were dropped as too stale (a learner rolled back by a
    kill), their places are taken by replacement batches past the run's own: then no group twice, and as many
    groups trained as the updates take."""
    groups = [key for record in records for key in record["groups"]]
    assert len(groups) == len(set(groups)), f"groups trained twice: {sorted(k for k in groups if groups.count(k) > 1)}"
    if records and records[-1].get("dropped_stale", 0):
        replaced = [key for key in groups if int(key.split("/")[0]) >= prompt_batches]
        assert replaced, f"{records[-1]['dropped_stale']} groups dropped as too stale, and none replaced"
        return
    per_step: dict[int, int] = {}
    for key in groups:
        step = int(key.split("/")[0])
        per_step[step] = per_step.get(step, 0) + 1
    assert sorted(per_step) == list(range(prompt_batches)), f"prompt batches trained: {sorted(per_step)}"
    assert len(set(per_step.values())) == 1, f"a prompt batch trained in part: {per_step}"
    # A streamed record's id is its prompt batch's, then "/<first row>-<last row>".
    batch_ids = sorted({batch_id.split("/")[0] for record in records for batch_id in record["batch_ids"]})
    assert batch_ids == [f"{run_id}-{i:08d}" for i in range(prompt_batches)]


def experience_of_steps(config, steps: int) -> list:
    """The experience of prompt batches ``0 .. steps−1``, made by the services in process (all sampled by v0)."""
    from services.advantage import AdvantageService
    from services.feeder import FeederService
    from services.generator import GeneratorService
    from services.scorer import ScorerService

    feeder, generator, scorer, advantage = (
        FeederService(config),
        GeneratorService(config),
        ScorerService(config),
        AdvantageService(config),
    )
    return [advantage.process(scorer.process(generator.process(feeder.batch(s))[0])[0])[0] for s in range(steps)]


def sampled_by(message, version: int):
    """``message`` (a rollout record or one made from it) as if every token had been sampled by ``version``."""
    import dataclasses

    import numpy as np

    real = np.arange(message.token_versions.shape[1]) < message.response_lengths[:, None]
    versions = np.where(real, version, 0).astype(np.int32)
    return dataclasses.replace(message, policy_version=version, token_versions=versions)


@functools.cache
def docker_answers() -> bool:
    """Whether a Docker engine answers the docker command."""
    import shutil
    import subprocess

    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@functools.cache
def image_available(image: str, pull: bool = False) -> bool:
    """Whether the Docker engine has ``image`` (or, with ``pull``, can pull it: a registry answers)."""
    import subprocess

    if not docker_answers():
        return False
    if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0:
        return True
    return pull and subprocess.run(["docker", "pull", "-q", image], capture_output=True, timeout=600).returncode == 0


def started_replica(service, bus, metrics=None):
    """The replica of ``service`` on ``bus``, started (services/runtime/replica.py): its channels connected and what
    its ``start()`` returns produced. A test that stops it stops it as a host does: ``stop(finished=False)``."""
    from services.runtime import Replica

    return Replica(service, lambda: bus, metrics).start()


def started(service, bus, metrics=None):
    """The runner of ``service``'s replica on ``bus``, started (:func:`started_replica`), for a test that never
    stops it."""
    return started_replica(service, bus, metrics).runner


def announce_v1(config, version=1, epoch=0):
    """Weights as the learner of ``epoch`` announces them after an update (here: perturbed v0 weights)."""
    import torch

    from services.learner import LearnerService

    learner = LearnerService(config)
    learner.epoch = epoch
    with torch.no_grad():
        for p in learner.trainer.actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    learner.trainer.version = version
    learner.groups_done = version * config.groups_per_update  # each update used up its groups
    return learner.announce()


def streamppo(*args, cwd=None) -> subprocess.CompletedProcess:
    """`streamppo ARGS` in this process (``services.cli.main``, what the console script calls): its exit code and what
    it printed. In process: a new interpreter for each (torch's import alone) cost seconds a test."""
    import contextlib
    import io
    import os
    import signal

    from services.cli import main

    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    cwd = cwd or Path(__file__).resolve().parent.parent  # the repository
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(before)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def one_line_error(result, code: int, *fragments: str) -> None:
    """``result`` failed with ``code`` and said why in lines naming every fragment, with no traceback."""
    assert result.returncode == code, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert all(fragment in result.stderr for fragment in fragments), result.stderr[-2000:]
