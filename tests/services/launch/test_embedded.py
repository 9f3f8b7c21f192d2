"""The whole loop in one process: the example trains, and the run directory holds what it promises."""

import json
import logging

import pytest
import torch

from services.launch.embedded import run_embedded


def assert_the_example_learned(run_dir, steps: int, keep_snapshots: int) -> None:
    """What a run of the example promises: the reward rises, on-policy, and the run directory holds it all."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    first = sum(r["reward_mean"] for r in records[:3]) / 3
    last = sum(r["reward_mean"] for r in records[-3:]) / 3
    # Random text is ~20% vowels; a policy that learned the task answers mostly in vowels, and in answers: a vowel
    # alone scores 1/8 (recipes.rewards.vowel_fraction), so the reward does not rise by saying next to nothing.
    assert first < 0.35 and last > first + 0.2, (first, last)
    assert all(r["response_length"] >= 8 for r in records[-3:]), [r["response_length"] for r in records[-3:]]
    generations = (run_dir / "generations.md").read_text().splitlines()[4:]  # after the title and the table's head
    after = [row.split(" | ")[-1].rstrip(" |") for row in generations if row.startswith("| ")]
    assert after and sum(map(len, after)) / len(after) > 1, after
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["dropped_stale"] == 0 and summary["dead_letters"] == 0
    # Strictly on-policy: every batch was sampled by the version the learner was at.
    assert all(r["staleness"] == 0 for r in records)
    # The sampler's log-probs are the learner's own: each update reached the sampler (vLLM: in place) before the
    # next batch was sampled.
    assert all(r["logprob_mismatch"] < 1e-3 for r in records)
    for key in ("kl", "policy_loss", "value_loss", "entropy", "clip_frac", "explained_variance", "grad_norm_actor"):
        assert all(key in r for r in records)
    assert (run_dir / "final" / "actor" / "config.json").is_file()
    assert (run_dir / "final" / "critic" / "config.json").is_file()
    snapshots = sorted(p.name for p in (run_dir / "weights").iterdir())
    assert snapshots[-1] == f"critic-v{steps:08d}.safetensors" and len(snapshots) == 2 * keep_snapshots


@pytest.mark.slow
def test_the_example_run_raises_the_reward(make_config):
    """In process, with the transformers backend; the README command below runs it with vLLM when installed."""
    config = make_config("run.steps=24", "generation.backend=transformers")
    run_embedded(config, progress=False)
    assert_the_example_learned(config.run.dir, 24, config.pipeline.keep_snapshots)


@pytest.mark.slow
def test_the_readme_command_runs_the_example_and_raises_the_reward(tmp_path, model_cache):
    """The README's run command, with the generator backend a user gets (vLLM when installed)."""
    import subprocess
    import sys

    from conftest import EXAMPLE, REPO

    from common.config import load_config

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "run",
            "--config",
            str(EXAMPLE / "config.yaml"),
            "--set",
            "run.steps=24",
            "--set",
            f"run.dir={tmp_path}/run",
            "--set",
            f"model.cache_dir={model_cache}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 24 steps" in result.stdout
    assert "ppo:" in result.stderr  # the progress bar
    # What a new user reads: no warning at all. Not vLLM's reload at each weight update (it said "Failed to load
    # weights" of the rotary embedding and the tied head at every one, 120 of the run's 134 lines), not vLLM's nor
    # torch's notice of Triton's CPU backend, not a missing vLLM (an INFO line, shown with -v only).
    output = result.stdout + result.stderr
    assert "Failed to load weights" not in output
    assert "vLLM is not installed" not in output
    noise = [line for line in output.splitlines() if "WARNING" in line or "Triton" in line or "triton" in line]
    assert not noise, output[-3000:]
    keep_snapshots = load_config(EXAMPLE / "config.yaml").pipeline.keep_snapshots
    assert_the_example_learned(tmp_path / "run", 24, keep_snapshots)
    # `streamppo status` of the finished run answers from its run directory (no broker to ask: it asked for one).
    status = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--run-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0 and status.stdout.startswith("finished: done: 24 steps"), status.stdout


def test_a_seeded_run_is_reproducible(make_config, tmp_path):
    rewards = []
    for name in ("a", "b"):
        config = make_config("run.steps=3", f"run.dir={tmp_path / name}")
        run_embedded(config, progress=False)
        rewards.append([json.loads(line)["reward_mean"] for line in (config.run.dir / "metrics.jsonl").open()])
    assert rewards[0] == rewards[1]


def test_a_reused_run_directory_is_cleared_out_loud_and_summarised_like_the_report(make_config, caplog):
    from common.report import load_metrics, summarise

    config = make_config("run.steps=4", "data.eval_prompts=0")
    run_embedded(config, progress=False)
    assert (config.checkpoint_dir / "LATEST").is_file()
    with caplog.at_level(logging.WARNING, logger="services.launch.embedded"):
        summary = run_embedded(config, progress=False)
    assert any("cleared the earlier run in" in r.getMessage() for r in caplog.records)
    assert summary.steps == 4, "started from scratch, not resumed from the old checkpoint"
    report = summarise(load_metrics(config.run.dir))
    rewards = [json.loads(line)["reward_mean"] for line in (config.run.dir / "metrics.jsonl").open()]
    window = report["window"]
    assert summary.summary_window == window == 2
    assert summary.reward_start == report["metrics"]["reward_mean"]["first"] == pytest.approx(sum(rewards[:2]) / 2)
    assert summary.reward_end == report["metrics"]["reward_mean"]["last"] == pytest.approx(sum(rewards[-2:]) / 2)


def test_max_staleness_one_lets_generation_run_one_version_ahead(make_config):
    config = make_config("run.steps=6", "pipeline.max_staleness=1")
    summary = run_embedded(config, progress=False)
    staleness = [json.loads(line)["staleness"] for line in (config.run.dir / "metrics.jsonl").open()]
    assert summary.steps == 6 and summary.dropped_stale == 0
    assert set(staleness) <= {0.0, 1.0} and 1.0 in staleness, "batch v+1 was sampled while v was being trained"


def test_delta_snapshots_train_exactly_as_full_ones(make_config, tmp_path):
    """bfloat16 snapshots at a small learning rate: deltas between full snapshots, bit for bit the same run."""
    from safetensors import safe_open

    runs = {}
    for full_every in (1, 4):
        config = make_config(
            "run.steps=6",
            f"run.dir={tmp_path / f'full-every-{full_every}'}",
            "weights.dtype=bfloat16",
            f"weights.full_every={full_every}",
            "learner.actor_lr=1e-5",
            "learner.critic_lr=1e-5",
            "pipeline.keep_snapshots=8",
            "data.eval_prompts=0",
        )
        run_embedded(config, progress=False)
        records = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").read_text().splitlines()]
        # Every statistic the same; the snapshots' digests differ, as a delta file is not a full one.
        ignored = {"time", "digests"}
        runs[full_every] = [{k: v for k, v in r.items() if "seconds" not in k and k not in ignored} for r in records]
        kinds = {}
        for path in sorted((config.run.dir / "weights").glob("actor-*.safetensors")):
            with safe_open(str(path), "pt") as snapshot:
                kinds[path.name] = "delta" if "base" in (snapshot.metadata() or {}) else "full"
        runs[f"kinds-{full_every}"] = list(kinds.values())
    assert runs["kinds-1"] == ["full"] * 6
    assert runs["kinds-4"] == ["full", "delta", "delta", "delta", "full", "delta"], "v1..v6, full every 4"
    assert runs[1] == runs[4], "the generator and the advantage service saw the same weights"


def test_broadcast_weights_train_exactly_as_stored_ones(make_config, tmp_path, caplog):
    """The actor sent to the generator over a gloo group: the same run, bit for bit, with the store's reads spared."""
    from services.transport.brokers.local_broker import free_port

    port = free_port()
    runs = {}
    for path in ("store", "broadcast"):
        caplog.clear()
        broadcast = [f"weights.broadcast.address=127.0.0.1:{port}"] if path == "broadcast" else []
        config = make_config("run.steps=4", f"run.dir={tmp_path / path}", "data.eval_prompts=0", *broadcast)
        with caplog.at_level(logging.INFO, logger="services.generator.service"):
            run_embedded(config, progress=False)
        records = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").read_text().splitlines()]
        runs[path] = [{k: v for k, v in r.items() if "seconds" not in k and k != "time"} for r in records]
        runs[f"{path}-loads"] = [
            r.getMessage().split()[3] for r in caplog.records if "loaded from the broadcast" in r.getMessage()
        ]
    assert runs["store-loads"] == []
    # Every version after the initial weights came by the broadcast (the first waited for the group to form).
    assert runs["broadcast-loads"] == ["v1", "v2", "v3", "v4"]
    assert runs["store"] == runs["broadcast"]


def test_a_critic_free_run_has_no_critic_anywhere(make_config, caplog):
    """GRPO: no service loads, trains, checkpoints or publishes a critic, and the experience on the topic says which
    estimator made it."""
    from helpers import read_messages

    from services.transport import MemoryBus

    steps = 4
    config = make_config(f"run.steps={steps}", "data.eval_prompts=0", example="grpo.yaml")
    bus = MemoryBus()
    with caplog.at_level(logging.INFO):
        run_embedded(config, progress=False, bus=bus)
    assert "advantage-0: grpo needs no critic; none is loaded" in caplog.text
    assert "critic weights" not in caplog.text  # nobody loaded, nor was offered, a critic snapshot
    run = config.run.dir
    assert {p.name.split("-v")[0] for p in (run / "weights").iterdir()} == {"actor"}
    checkpoint = (run / "checkpoints" / (run / "checkpoints" / "LATEST").read_text().strip()) / "trainer.pt"
    assert set(torch.load(checkpoint, weights_only=True)) >= {"actor", "actor_optimizer"}
    assert not {"critic", "critic_optimizer"} & set(torch.load(checkpoint, weights_only=True))
    assert sorted(p.name for p in (run / "final").iterdir()) == ["actor"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert len(records) == steps and all("grad_norm_critic" not in r and "value_loss" not in r for r in records)
    experience = read_messages(bus, "experience")
    assert len(experience) == steps
    for message in experience:
        assert message.lineage["shaping.estimator"] == "grpo" and "critic.version" not in message.lineage
        assert not message.values.any(), "values are zeros: there is no critic"
        assert message.advantages.any()
    announced = {m.model for m in read_messages(bus, "weights")}
    assert announced == {"actor"}


def test_a_signed_run_trains_as_an_unsigned_one(make_config, tmp_path, monkeypatch):
    """With a signing key every message is signed and checked, and the run is the same, step for step."""
    monkeypatch.setenv("RUN_SIGNING_KEY", "a key")
    rewards = []
    for name, key in (("plain", []), ("signed", ["pipeline.signing_key_env=RUN_SIGNING_KEY"])):
        config = make_config("run.steps=3", "data.eval_prompts=0", f"run.dir={tmp_path / name}", *key)
        summary = run_embedded(config, progress=False)
        assert summary.dead_letters == 0
        rewards.append([json.loads(line)["reward_mean"] for line in (config.run.dir / "metrics.jsonl").open()])
    assert rewards[0] == rewards[1] and len(rewards[0]) == 3


def _hostile_records():
    """Records any client of the broker can write: a topic of the run, a key and a value each null or arbitrary
    bytes, a value that is msgpack (of a pipeline schema's name, with arbitrary fields) or not."""
    import msgpack
    from hypothesis import strategies as st

    from common.schema import TOPIC_MESSAGE
    from services.roles import COMPACTED_TOPICS
    from services.transport import dlq_topic

    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=8),
    )
    fields = st.dictionaries(st.text(max_size=12), scalars, max_size=6)
    schemas = st.sampled_from(sorted({message.SCHEMA for message in TOPIC_MESSAGE.values()}))
    claims = st.builds(
        lambda schema, version, rest: {"schema": schema, "version": version, **rest}, schemas, st.integers(0, 6), fields
    )
    values = st.one_of(
        st.none(),
        st.binary(max_size=64),
        st.builds(lambda raw: msgpack.packb(raw, use_bin_type=True), st.one_of(claims, fields, scalars)),
    )
    topics = st.sampled_from(sorted({*TOPIC_MESSAGE, *COMPACTED_TOPICS, *(dlq_topic(t) for t in TOPIC_MESSAGE)}))
    return st.lists(st.tuples(topics, st.one_of(st.none(), st.binary(max_size=16)), values), min_size=1, max_size=24)


def test_records_any_client_writes_on_any_topic_never_stop_the_run_or_change_its_result(make_config):
    """A property test: arbitrary records on every topic of the run, written before it starts, and the run reaches
    its steps with every group once; what was taken for input is dead-lettered or skipped, never trained."""
    from hypothesis import HealthCheck, given, settings

    from services.roles import pipeline_topics
    from services.transport import MemoryBus

    config = make_config(
        "run.steps=2",
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "learner.mini_batch_size=4",
        "run.archive_log=false",
    )
    clean = None

    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_hostile_records())
    def run_beside(records):
        nonlocal clean
        bus = MemoryBus()
        bus.create_topics(pipeline_topics())
        producer = bus.producer("saboteur")
        for topic, key, value in records:
            producer.send(topic, value, key=key)
        summary = run_embedded(config, progress=False, bus=bus)
        lines = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").read_text().splitlines()]
        assert summary.steps == 2 and [line["step"] for line in lines] == [1, 2]
        trained = [(line["groups"], line["reward_mean"]) for line in lines]
        assert clean is None or trained == clean, "the records changed what was trained"

    run_embedded(config, progress=False)
    clean = [
        (line["groups"], line["reward_mean"])
        for line in map(json.loads, (config.run.dir / "metrics.jsonl").read_text().splitlines())
    ]
    run_beside()


def test_the_evaluator_scores_held_out_prompts_while_the_run_trains_and_changes_nothing_of_it(make_config):
    """eval.every versions and the last, in eval.jsonl, plotted by the report; the training itself is the run's
    without an evaluator, update for update (the evaluator's seeded sampling leaves the other roles' draws alone)."""
    from conftest import EXAMPLE

    from common.report import load_eval, write_report

    plain = make_config("run.steps=6", "data.eval_prompts=0")
    run_embedded(plain, progress=False)
    without = [json.loads(line) for line in (plain.run.dir / "metrics.jsonl").read_text().splitlines()]
    config = make_config("run.steps=6", "data.eval_prompts=0", f"eval.prompts={EXAMPLE / 'heldout.jsonl'}",
                         "eval.every=2")  # fmt: skip
    run_embedded(config, progress=False)
    lines = load_eval(config.run.dir)
    assert [line["policy_version"] for line in lines] == [0, 2, 4, 6]
    assert all(line["prompts"] == 16 and 0 <= line["reward_mean"] <= 1 for line in lines)
    with_eval = [json.loads(line) for line in (config.run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["groups"], r["reward_mean"], r["kl"]) for r in with_eval] == [
        (r["groups"], r["reward_mean"], r["kl"]) for r in without
    ]
    paths, summary = write_report(config.run.dir)
    assert config.run.dir / "report" / "held_out_reward.png" in paths
    assert summary["held_out"]["first"]["step"] == 0 and summary["held_out"]["last"]["step"] == 6
