"""Configuration is validated at start-up; every bad input stops the command with a message naming it."""

import json
import re

import pytest
from conftest import EXAMPLE, REPO
from helpers import one_line_error, streamppo

from common.config import ConfigError, load_config


def test_the_example_config_loads_with_overrides():
    config = load_config(EXAMPLE / "config.yaml", ["run.steps=7", "algorithm.adaptive_kl={target: 3, horizon: 500}"])
    assert config.run.steps == 7
    assert config.algorithm.adaptive_kl.target == 3
    assert config.data.prompts == EXAMPLE / "prompts.jsonl"  # relative to the config file


@pytest.mark.parametrize(
    "override, field",
    [
        ("learner.actor_lr=-1", "learner.actor_lr"),
        ("generation.n=0", "generation.n"),
        ("algorithm.kl_estimator=k9", "algorithm.kl_estimator"),
        ("learner.clip_low=1.5", "learner.clip_low"),
        ("learner.dual_clip=0.5", "learner.dual_clip"),
        ("learner.typo_field=3", "learner.typo_field"),
        ("pipeline.max_staleness=-1", "pipeline.max_staleness"),
        ("reward.model=/some/rm", "reward"),
        ("learner.mini_batch_size=1000", "mini_batch_size"),
    ],
)
def test_a_bad_value_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(EXAMPLE / "config.yaml", [override])


def test_a_run_key_is_made_once_for_the_run_and_shared_by_its_services(tmp_path):
    """pipeline.run_key: the first service writes a random key into the run directory (mode 0600), every other one
    reads the same; without it, and with no key named, a run is unsigned; a key named wins."""
    settings = [f"run.dir={tmp_path / 'run'}"]
    assert load_config(EXAMPLE / "config.yaml", settings).signing_key() is None
    keys = {load_config(EXAMPLE / "config.yaml", [*settings, "pipeline.run_key=true"]).signing_key() for _ in range(3)}
    (key,) = keys
    assert len(key) == 64 and (tmp_path / "run" / "signing.key").stat().st_mode & 0o777 == 0o600
    other = load_config(EXAMPLE / "config.yaml", [f"run.dir={tmp_path / 'other'}", "pipeline.run_key=true"])
    other = other.signing_key()
    assert other != key  # another run, another key
    (tmp_path / "named").write_text("mine\n")
    named = [*settings, "pipeline.run_key=true", f"pipeline.signing_key_file={tmp_path / 'named'}"]
    assert load_config(EXAMPLE / "config.yaml", named).signing_key() == b"mine"


def test_a_function_named_by_its_file_is_found_from_the_config_s_folder_as_the_prompts_are(tmp_path, monkeypatch):
    """One rule for relative paths: `reward.function: my_reward.py:score` beside the config is found from any working
    directory, as `data.prompts: prompts.jsonl` is."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_reward.py").write_text("def score(prompt, response, label):\n    return 1.0\n")
    (folder / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    config_text = (EXAMPLE / "config.yaml").read_text().replace("recipes.rewards:vowel_fraction", "my_reward.py:score")
    (folder / "run.yaml").write_text(config_text)
    monkeypatch.chdir(tmp_path)  # elsewhere
    config = load_config(folder / "run.yaml")
    assert config.reward.function == f"{folder / 'my_reward.py'}:score"
    assert str(config.data.prompts) == str(folder / "prompts.jsonl")
    from common.rewards import load_reward_function

    assert load_reward_function(config.reward.function) is not None


def test_the_checks_before_a_run_resolve_a_judge_s_model_as_the_scorer_would(tmp_path):
    """One reward factory (common/rewards): what the scorer loads is what the checks before a run look for, a judge's
    model folder included."""
    from common.models import ModelLoadError
    from common.rewards import check_reward

    judge = [
        "reward.function=null", f"reward.judge.model={tmp_path / 'no-judge'}",
        "reward.judge.template='Rate {response}'", "reward.judge.pattern='Score: (\\d+)'",
    ]  # fmt: skip
    with pytest.raises(ModelLoadError, match="no-judge"):
        check_reward(load_config(EXAMPLE / "config.yaml", judge))
    check_reward(load_config(EXAMPLE / "config.yaml"))  # the example's function loads


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(EXAMPLE / "config.yaml", ["nonsense"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(REPO / "nope.yaml")


def test_trust_remote_code_is_off_unless_configured():
    assert load_config(EXAMPLE / "config.yaml").model.trust_remote_code is False


def test_protos_are_current():
    result = streamppo("protos")
    assert result.returncode == 0, result.stderr


def test_the_kafka_client_takes_every_setting_of_the_config_s_section_by_name_with_the_same_defaults():
    """One place for each Kafka default: the client (services/transport/kafka/, which knows nothing of the config)
    and the config's kafka section name a setting alike and agree on its default, and the run's bus passes each one
    set in the config through (a default that drifted once: connect_timeout_s, 30 s in one and 60 s in the other)."""
    import dataclasses

    from common.config import KafkaSection
    from services.runtime.run_bus import kafka_settings
    from services.transport.kafka import KafkaSettings

    client = {f.name: f.default for f in dataclasses.fields(KafkaSettings) if f.default is not dataclasses.MISSING}
    shared = set(client) & set(KafkaSection.model_fields)
    assert {"session_timeout_ms", "connect_timeout_s", "max_message_bytes", "replication_factor"} <= shared
    assert {name: client[name] for name in shared} == {name: getattr(KafkaSection(), name) for name in shared}
    changed = KafkaSection(
        session_timeout_ms=7000, connect_timeout_s=5, fetch_max_wait_ms=7, idempotent_producer=False,
        request_timeout_ms=2500, static_members=False,
    )  # fmt: skip
    settings = kafka_settings(changed, "b:9092")
    assert (settings.session_timeout_ms, settings.connect_timeout_s, settings.fetch_max_wait_ms) == (7000, 5, 7)
    assert settings.bootstrap == "b:9092" and not settings.idempotent_producer
    assert settings.request_timeout_ms == 2500 and not settings.static_members


def test_a_request_timeout_no_longer_than_the_broker_may_hold_a_fetch_is_refused():
    """Every fetch would time out before the broker answered it (kafka-python refuses such a consumer, naming
    neither setting as the config does)."""
    with pytest.raises(ConfigError, match=r"request_timeout_ms \(500\) must exceed fetch_max_wait_ms \(500\)"):
        load_config(EXAMPLE / "config.yaml", ["kafka.request_timeout_ms=500", "kafka.fetch_max_wait_ms=500"])
    assert load_config(EXAMPLE / "config.yaml", ["kafka.request_timeout_ms=501", "kafka.fetch_max_wait_ms=500"])


def test_kafka_security_settings_pass_through_with_secrets_from_the_environment(tmp_path, monkeypatch):
    from services.transport.kafka import KafkaSettings

    overrides = [
        "kafka.security_protocol=SASL_SSL",
        "kafka.sasl_mechanism=SCRAM-SHA-512",
        "kafka.sasl_username=ppo",
        "kafka.sasl_password_env=TEST_KAFKA_PASSWORD",
    ]
    config = load_config(EXAMPLE / "config.yaml", overrides)
    with pytest.raises(ConfigError, match="TEST_KAFKA_PASSWORD is not set"):
        config.kafka.client_options()
    monkeypatch.setenv("TEST_KAFKA_PASSWORD", "s3cret-value")
    options = config.kafka.client_options()
    assert options == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "ppo",
        "sasl_plain_password": "s3cret-value",
    }
    # The secret is in none of what gets printed or written: the settings' repr, the saved config.
    assert "s3cret" not in repr(KafkaSettings(bootstrap="b:9092", security=options))
    assert "s3cret" not in config.model_dump_json()
    secret_file = tmp_path / "password"
    secret_file.write_text("from-a-file\n")
    from_file = load_config(EXAMPLE / "config.yaml", overrides[:3] + [f"kafka.sasl_password_file={secret_file}"])
    assert from_file.kafka.client_options()["sasl_plain_password"] == "from-a-file"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["kafka.security_protocol=SASL_PLAINTEXT"], "needs sasl_mechanism"),
        (["kafka.sasl_mechanism=PLAIN"], "is not SASL"),
        (["kafka.security_protocol=SASL_SSL", "kafka.sasl_mechanism=PLAIN", "kafka.sasl_username=u"], "exactly one"),
        (["kafka.security_protocol=SSLX"], "kafka.security_protocol"),
    ],
)
def test_incomplete_kafka_security_is_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(EXAMPLE / "config.yaml", overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["algorithm.estimator=grpo"],
            "algorithm.gamma, algorithm.lam, learner.critic_lr, learner.value_clip are set, but no chosen variant "
            "reads them .algorithm.estimator grpo, which runs without a critic.",
        ),
        (["algorithm.estimator=rloo", "model.critic=some/critic"], "model.critic"),
        (["algorithm.estimator=ppo"], "algorithm.estimator"),
        (["algorithm.kl_in=advantage"], "algorithm.kl_in"),
        (["learner.loss_agg=seq-sum"], "learner.loss_agg"),
        (["learner.off_policy.token_band=[1.2, 2.0]"], r"token_band \[1.2, 2.0\] must hold 1 strictly inside"),
        (["learner.off_policy.applies_to=fresh"], "learner.off_policy.applies_to"),
        (["algorithm.overlong_penalty=0.5"], "algorithm.overlong_penalty is set, but only algorithm.overlong_buffer"),
        (["algorithm.overlong_buffer=64"], r"overlong_buffer \(64\) must be shorter than generation.max_new_tokens"),
    ],
)
def test_algorithm_settings_that_do_not_fit_the_estimator_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(EXAMPLE / "config.yaml", overrides)


def test_the_grpo_example_needs_groups():
    grpo = EXAMPLE / "grpo.yaml"
    config = load_config(grpo)
    assert config.algorithm.estimator == "grpo" and not config.algorithm.uses_critic and not config.algorithm.whitens
    with pytest.raises(ConfigError, match="generation.n must be at least 2 .it is 1."):
        load_config(grpo, ["generation.n=1", "learner.mini_batch_size=16"])
    with pytest.raises(ConfigError, match="algorithm.whiten_advantages is set, but no chosen variant reads it"):
        load_config(grpo, ["algorithm.whiten_advantages=true"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["weights.digest=md5"], "weights.digest"),
        (["weights.full_every=0"], "weights.full_every"),
        (
            ["learner.parallel.strategy=fsdp", "learner.parallel.processes=2", "weights.full_every=4"],
            "delta snapshots.*needs the whole state on one process",
        ),
        (["weights.broadcast.address=learner"], "weights.broadcast.address"),
        (["weights.broadcast.address=learner:29600", "weights.broadcast.receivers=0"], "weights.broadcast.receivers"),
        (
            ["weights.broadcast.address=learner:29600", "model.lora={rank: 8}"],
            "LoRA adapters .a few MB. go by the store",
        ),
    ],
)
def test_weight_settings_that_cannot_work_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(EXAMPLE / "config.yaml", overrides)


def test_up_against_a_broker_that_does_not_answer_stops_in_seconds_with_exit_2_and_what_to_check(tmp_path):
    import time

    from services.transport.brokers.local_broker import free_port

    started = time.monotonic()
    result = streamppo("up", "--config", EXAMPLE / "config.yaml", "--bootstrap", f"127.0.0.1:{free_port()}",
                       "--set", f"run.dir={tmp_path / 'run'}")  # fmt: skip
    assert time.monotonic() - started < 30 and result.returncode == 2, result.stderr
    assert "no broker answers at 127.0.0.1:" in result.stderr and "advertised listeners" in result.stderr


def test_a_service_started_alone_exits_2_on_a_setting_that_names_what_cannot_be_had(tmp_path, model_cache):
    """What `up` (or Kubernetes) sees of a service whose configuration cannot work: exit 2, not restarted."""
    from services.runtime import exit_codes

    result = streamppo(
        "scorer",
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--bootstrap",
        "127.0.0.1:9",
        "--set",
        "reward.function=no_such_module:score",
        "--set",
        f"model.cache_dir={model_cache}",
    )
    one_line_error(result, exit_codes.CONFIG, "no_such_module:score")
    assert 2 in exit_codes.PERMANENT


def test_the_config_reference_is_the_code_s():
    """docs/config-reference.md holds every setting as common/config/ declares it (`streamppo config-reference
    --write docs/config-reference.md` after a change)."""
    from common.config import reference

    text = reference()
    assert (REPO / "docs" / "config-reference.md").read_text() == text, "run streamppo config-reference --write"
    for setting in ("`learner.actor_lr`", "`generation.vllm.kv_cache_gib`", "`gateway.agent.function`"):
        assert setting in text
    assert "| `learner.clip_low` | float | `0.2` | > 0, < 1 |" in text


def test_a_mistyped_setting_is_answered_with_the_nearest_one(make_config):
    with pytest.raises(ConfigError, match="learner.actor_lrr: no such setting; did you mean `learner.actor_lr`"):
        make_config("learner.actor_lrr=1e-3")
    with pytest.raises(ConfigError, match="generation.vllm.kv_cahce_gib: no such setting; did you mean "
                                          "`generation.vllm.kv_cache_gib`"):  # fmt: skip
        make_config("generation.vllm.kv_cahce_gib=1")
    with pytest.raises(ConfigError, match="zzz: no such setting \\(the settings here: run, model"):
        make_config("zzz.x=1")


def test_a_hub_id_for_a_model_says_how_to_get_the_folder(tmp_path):
    from common.models import ModelLoadError, resolve_model

    with pytest.raises(ModelLoadError, match="is a Hugging Face hub id.*huggingface-cli download Qwen/Qwen2.5-0.5B"):
        resolve_model("Qwen/Qwen2.5-0.5B", tmp_path)
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model(str(tmp_path / "nowhere"), tmp_path)


def test_the_shortest_config_of_the_own_model_page_is_a_config(tmp_path):
    """docs/your-model-and-data.md's config, as a user copies it: valid, and what it leaves out has the defaults the
    page says (20 updates of 8 prompts × 4 answers of 32 tokens, on-policy)."""
    page = (REPO / "docs" / "your-model-and-data.md").read_text()
    block = page.split("## The shortest config that trains them")[1].split("```yaml\n")[1].split("```")[0]
    (tmp_path / "run.yaml").write_text(block)
    config = load_config(tmp_path / "run.yaml")
    assert config.algorithm.estimator == "grpo" and config.reward.function == "my_reward.py:score"
    assert (config.run.steps, config.data.batch_size, config.generation.n) == (20, 8, 4)
    assert config.generation.max_new_tokens == 32 and config.pipeline.max_staleness == 0
    # Made smaller, it still loads: an unset mini-batch is at most the responses per update.
    smaller = load_config(tmp_path / "run.yaml", ["data.batch_size=2"])
    assert smaller.learner.mini_batch_size == 2 * 4


def test_status_of_a_run_whose_broker_does_not_answer_answers_from_the_run_directory_in_seconds(tmp_path):
    """The broker is away (nothing listens at its address): `status` says so within seconds, and shows the run's
    last update and the status it last read, each replica silent since its last report."""
    import time

    from common.schema import ReplicaStatus
    from services.ops.status import PipelineStatus, save_status
    from services.transport.brokers.local_broker import free_port

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_config(EXAMPLE / "config.yaml", ["run.run_id=away", f"run.dir={run_dir}"])
    (run_dir / "config.json").write_text(config.model_dump_json(exclude_unset=True))
    (run_dir / "broker").write_text(f"127.0.0.1:{free_port()}")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 7}) + "\n")
    report = ReplicaStatus(
        "scorer-0", "scorer", "away", "serving", "", 0, 0.0, 0, {"processed": 7}, time.time() - 300, ""
    )
    save_status(run_dir, PipelineStatus("away", {"scorer-0": report}, {"actor": 7}, {}, brokers=1))
    started = time.monotonic()
    result = streamppo("status", "--run-dir", run_dir)
    assert time.monotonic() - started < 20, "status waited for the broker as long as a service would"
    assert result.returncode == 1 and "the broker does not answer" in result.stderr
    assert "last update: step 7" in result.stdout
    assert re.search(r"^scorer-0 +silent ", result.stdout, re.M), result.stdout
    assert re.search(r"no report for 30\d s .*it last said serving", result.stdout), result.stdout


def test_an_agent_placed_remote_needs_no_function_and_one_placed_local_does(make_config):
    remote = make_config("generation.streaming=true", "gateway.agent.placement=remote")
    assert remote.gateway.agent.function is None
    with pytest.raises(ConfigError, match="gateway.agent.function is required with placement local"):
        make_config("generation.streaming=true", "gateway.agent.placement=local")


def test_the_gpu_config_for_a_qwen_class_model_validates_and_names_the_folder_to_download(tmp_path):
    """examples/qwen/ppo.yaml (docs/gpu.md): every setting valid; without the model folder, the check before a run
    names it and says what to do, in seconds."""
    from common.models import ModelLoadError
    from services.launch.preflight import check_run_inputs

    config = load_config(REPO / "examples" / "qwen" / "ppo.yaml", [f"run.dir={tmp_path / 'run'}"])
    assert config.model.device == "cuda" and config.model.dtype == "bfloat16"
    assert config.generation.backend == "vllm" and config.generation.vllm.gpu_memory_utilization == 0.35
    assert config.learner.mini_batch_size % config.learner.micro_batch_size == 0
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + {i} =", "label": str(2 * i)}) + "\n" for i in range(64)))
    config = load_config(
        REPO / "examples" / "qwen" / "ppo.yaml",
        [f"run.dir={tmp_path / 'run'}", f"data.prompts={prompts}", f"model.actor={tmp_path / 'qwen2.5-0.5b'}"],
    )
    with pytest.raises(ModelLoadError, match="qwen2.5-0.5b"):
        check_run_inputs(config)
