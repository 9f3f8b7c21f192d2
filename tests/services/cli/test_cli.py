"""The `streamppo` command: every error a user can fix is one line naming it, with its exit code; settings from the
environment and --set."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from conftest import EXAMPLE, REPO
from helpers import one_line_error, streamppo


def test_cli_exits_2_and_names_the_field(tmp_path):
    result = streamppo("run", "--config", str(EXAMPLE / "config.yaml"), "--set", "learner.ppo_epochs=0")
    assert result.returncode == 2
    assert "learner.ppo_epochs" in result.stderr and "greater than 0" in result.stderr


def test_cli_reports_a_missing_model_clearly(tmp_path):
    result = streamppo(
        "run",
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--set",
        f"model.actor={tmp_path}/no-model",
        "--set",
        f"run.dir={tmp_path}/run",
    )
    assert result.returncode == 2, "a configuration error: no restart can cure it"
    assert "no-model" in result.stderr and "Traceback" not in result.stderr


def test_cli_reports_a_broken_prompt_file(tmp_path, model_cache):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "wrong key"}) + "\n")
    result = streamppo(
        "run",
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--set",
        f"data.prompts={prompts}",
        "--set",
        f"model.cache_dir={model_cache}",
        "--set",
        f"run.dir={tmp_path}/run",
    )
    assert result.returncode == 2
    assert "prompts.jsonl:2" in result.stderr


def test_cli_reports_a_bad_reward_function(tmp_path, model_cache):
    result = streamppo(
        "run",
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--set",
        "reward.function=common.rewards:nope",
        "--set",
        f"model.cache_dir={model_cache}",
        "--set",
        f"run.dir={tmp_path}/run",
    )
    assert result.returncode == 2
    assert "common.rewards:nope" in result.stderr


def test_cli_reports_a_batch_larger_than_the_dataset(tmp_path, model_cache):
    result = streamppo(
        "run",
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--set",
        "data.batch_size=500",
        "--set",
        f"run.dir={tmp_path}/run",
        "--set",
        f"model.cache_dir={model_cache}",
        "--set",
        "generation.backend=transformers",
    )
    one_line_error(result, 2, "data.batch_size 500", "120 prompts")


def test_cli_reports_a_device_this_machine_lacks(tmp_path, model_cache):
    lacking = f"cuda:{torch.cuda.device_count()}"  # one GPU past the last this machine has (cuda:0 on none)
    result = streamppo(
        "run",
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--set",
        f"model.device={lacking}",
        "--set",
        f"run.dir={tmp_path}/run",
        "--set",
        f"model.cache_dir={model_cache}",
        "--set",
        "generation.backend=transformers",
    )
    one_line_error(result, 2, f"onto {lacking}", "CUDA")


def test_cli_reports_a_malformed_bootstrap_before_loading_anything(tmp_path):
    result = streamppo(
        "scorer",
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--bootstrap",
        "host:notaport",
        "--set",
        f"model.actor={tmp_path}/never-loaded",
    )
    one_line_error(result, 2, "host:notaport", "HOST:PORT")


def test_cli_reports_a_metrics_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = streamppo(
            "scorer",
            "--config",
            str(EXAMPLE / "config.yaml"),
            "--bootstrap",
            "127.0.0.1:9",
            "--metrics-port",
            str(port),
            "--set",
            f"model.actor={tmp_path}/never-loaded",
        )
    one_line_error(result, 2, f"--metrics-port {port}", "in use")


def test_cli_reports_a_full_weight_store_in_one_line(tmp_path, model_cache, small_disk):
    disk = small_disk(64)  # smaller than one snapshot of the tiny model
    result = streamppo(
        "run",
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--set",
        "run.steps=2",
        "--set",
        f"run.dir={tmp_path}/run",
        "--set",
        f"model.cache_dir={model_cache}",
        "--set",
        "generation.backend=transformers",
        "--set",
        f"pipeline.weight_store={disk}",
    )
    one_line_error(result, 3, f"no space left on {disk}", "snapshot", "MB free")
    assert not list(disk.iterdir()), "no partial snapshot left behind"


def test_cli_reports_an_unreachable_broker_briefly(tmp_path, model_cache):
    from services.transport.brokers.local_broker import free_port

    result = streamppo(
        "scorer",
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--bootstrap",
        f"127.0.0.1:{free_port()}",
        "--set",
        "kafka.connect_timeout_s=3",
        "--set",
        f"model.cache_dir={model_cache}",
    )
    one_line_error(result, 1, "no Kafka broker reachable", "kafka.connect_timeout_s")
    assert len(result.stderr.strip().splitlines()) <= 3, result.stderr  # the wait, the error: no flood


@pytest.mark.parametrize(
    "setting, named",
    [
        ("data.prompts={tmp}/missing.jsonl", "data.prompts: cannot read prompt file {tmp}/missing.jsonl"),
        ("eval.prompts={tmp}/held.jsonl", "eval.prompts: cannot read prompt file {tmp}/held.jsonl"),
        ("reward.function=no_such_module:score", "no_such_module:score"),
        ("model.critic={tmp}/no-critic", "no-critic"),
    ],
    ids=["prompt file", "held-out prompt file", "reward function", "model folder"],
)
@pytest.mark.parametrize("command", ["run", "up"])
def test_a_setting_that_names_what_cannot_be_had_fails_fast_with_exit_2(command, setting, named, tmp_path, model_cache):
    """`up` checks the prompt file, the reward function and the models before it starts a broker or a service, and
    stops with the code a supervisor does not restart; `run` (and each service alone) exits with the same code."""
    import time

    started = time.monotonic()
    result = streamppo(
        command,
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--set",
        setting.format(tmp=tmp_path),
        "--set",
        f"run.dir={tmp_path}/run",
        "--set",
        f"model.cache_dir={model_cache}",
        "--set",
        "generation.backend=transformers",
    )
    one_line_error(result, 2, named.format(tmp=tmp_path))
    assert "serving on" not in result.stdout, "nothing was started"
    assert time.monotonic() - started < 60


def test_cli_takes_settings_from_the_environment_and_set_wins(tmp_path):
    """$STREAMPPO_SET (one compose override's settings for every service) is read as --set entries, before them."""
    env = dict(os.environ, STREAMPPO_SET="learner.ppo_epochs=0 run.steps=3")
    bad = subprocess.run(
        [sys.executable, "-m", "services.cli", "topics", "--config", str(EXAMPLE / "config.yaml")],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    one_line_error(bad, 2, "learner.ppo_epochs", "greater than 0")
    mended = subprocess.run(
        [sys.executable, "-m", "services.cli", "topics", "--config", str(EXAMPLE / "config.yaml"),
         "--set", "learner.ppo_epochs=1", "--bootstrap", "host:notaport"],
        cwd=REPO, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    one_line_error(mended, 2, "host:notaport", "HOST:PORT")  # past the config: --set won


@pytest.mark.parametrize("spec", ["abc", "9130-9120", "0", "9100-70000"])
def test_cli_reports_a_bad_metrics_port_range(tmp_path, spec):
    result = streamppo(
        "scorer", "--config", str(EXAMPLE / "config.yaml"), "--bootstrap", "127.0.0.1:9",
        "--metrics-port", spec, "--set", f"model.actor={tmp_path}/never-loaded",
    )  # fmt: skip
    one_line_error(result, 2, f"--metrics-port {spec!r}")
