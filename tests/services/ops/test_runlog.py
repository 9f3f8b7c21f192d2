"""The log as a product: an archived run's log read back, exported to Parquet, traced, rescored; retention of
referenced batches; the learner's trackers (MLflow's store and W&B's offline files read back)."""

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from common.batch_store import BatchStore
from common.log_archive import ArchiveError, LogArchive
from common.schema import ExperienceBatch, PromptBatch, RolloutBatch, ScoredBatch, decode, encode, group_key
from services.ops.runlog.archive import batch_reference
from services.ops.runlog.reader import ArchiveReader
from services.ops.runlog.rescore import average_ranks, compare_scores

# Not from conftest: `streamppo rescore` imports this module, outside pytest, for its reward function.
REPO = Path(__file__).resolve().parents[3]

STEPS = 3


def response_letters(prompts, responses):
    """A reward the run did not train on, for rescoring: each response's length in characters."""
    return [float(len(r)) for r in responses]


# The tests of the module's archived run go to one worker under pytest-xdist, which then makes that run once.
shares_the_run = pytest.mark.xdist_group("archived-run")


@pytest.fixture(scope="module")
def archived_run(tmp_path_factory, model_cache):
    """A 3-update embedded run whose batches all travel by reference, its log archived at its end, then its batch
    store deleted: everything below reads the archive alone."""
    from common.config import load_config
    from services.launch.embedded import run_embedded

    root = tmp_path_factory.mktemp("archived")
    config = load_config(
        REPO / "examples" / "vowels" / "config.yaml",
        [
            f"run.dir={root / 'run'}",
            f"model.cache_dir={model_cache}",
            "generation.backend=transformers",
            f"run.steps={STEPS}",
            "run.archive_log=true",
            "pipeline.inline_max_bytes=3000",
        ],
    )
    run_embedded(config, progress=False)
    shutil.rmtree(config.batch_store)
    return config, root / "run"


def archived(run_dir: Path, message_type: type) -> list:
    reader = ArchiveReader.open(run_dir / "log")
    messages = [message for _, message in reader.messages(message_type)]
    assert not reader.unreadable
    return messages


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def streamppo(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result


@shares_the_run
def test_the_archive_holds_every_record_and_each_referenced_batch(archived_run):
    config, run_dir = archived_run
    archive = LogArchive(run_dir / "log")
    assert archive.run_id == config.run.run_id and archive.identity
    for message_type in (PromptBatch, RolloutBatch, ScoredBatch, ExperienceBatch):
        messages = archived(run_dir, message_type)
        assert sorted(m.step for m in messages) == list(range(STEPS)), message_type.SCHEMA
    assert len(list((run_dir / "log" / "batches").iterdir())) == 4 * STEPS, "every batch went by reference"
    weights = [decode(r.value) for r in archive.records("weights")]
    assert [w.policy_version for w in weights if w.model == "actor"] == list(range(1, STEPS + 1))


@shares_the_run
def test_a_damaged_archive_is_named_and_its_bad_records_skipped(archived_run, tmp_path):
    _, run_dir = archived_run
    copy = tmp_path / "log"
    shutil.copytree(run_dir / "log", copy)
    victim = sorted((copy / "batches").glob("scored-*"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    reader = ArchiveReader.open(copy)
    assert len([m for _, m in reader.messages(ScoredBatch)]) == STEPS - 1
    (skipped,) = reader.unreadable
    assert skipped.topic == "scored" and "do not match" in skipped.error
    (copy / "manifest.json").unlink()
    with pytest.raises(ArchiveError, match="no manifest.json"):
        ArchiveReader.open(copy)


@shares_the_run
def test_the_export_is_one_row_per_response_readable_with_datasets(archived_run, tmp_path):
    import datasets

    config, run_dir = archived_run
    streamppo("export", "--log", str(run_dir / "log"), "--out", str(tmp_path / "export"))
    rows = datasets.load_dataset("parquet", data_files=str(tmp_path / "export" / "experience.parquet"))["train"]
    rollouts = datasets.load_dataset("parquet", data_files=str(tmp_path / "export" / "rollouts.parquet"))["train"]
    responses = STEPS * config.data.batch_size * config.generation.n
    assert len(rows) == len(rollouts) == responses
    trained = {group: r["step"] for r in metrics(run_dir) for group in r["groups"]}
    responses_of = {}  # (group, sample) -> (message, row): the archive's responses, each group's in order
    for message in archived(run_dir, ExperienceBatch):
        for i, g in enumerate(message.group_index):
            group = group_key(message.step, int(g))
            sample = sum(1 for key in responses_of if key[0] == group)
            responses_of[(group, sample)] = (message, i)
    seen = set()
    for row in rows:
        message, i = responses_of[(row["group"], row["sample"])]
        length = int(message.response_lengths[i])
        assert row["response"] == message.response_text[i] and row["prompt"] == message.prompt_text[i]
        assert row["reward"] == pytest.approx(float(message.scores[i]))
        assert row["advantages"] == pytest.approx(message.advantages[i, :length].tolist())
        assert len(row["behaviour_logprobs"]) == row["response_length"] == length
        assert row["trained_in"] == trained[row["group"]], "the update that trained it, from metrics.jsonl"
        assert row["policy_version_min"] == row["policy_version_max"] == row["trained_in"] - 1
        assert row["generator"] == "generator-0" and json.loads(row["lineage"])["run.id"] == config.run.run_id
        seen.add((row["group"], row["sample"]))
    assert len(seen) == responses
    frame = rows.to_pandas()
    assert frame.groupby("trained_in").size().to_dict() == {v: responses // STEPS for v in range(1, STEPS + 1)}


@shares_the_run
def test_trace_names_what_made_an_update_and_which_updates_a_prompt_trained(archived_run):
    config, run_dir = archived_run
    update = 2
    answer = json.loads(streamppo("trace", "--log", str(run_dir / "log"), "--update", str(update), "--json").stdout)
    (line,) = [r for r in metrics(run_dir) if r["step"] == update]
    assert [g["group"] for g in answer["groups"]] == line["groups"]
    # What the test knows independently: the prompt batch of the groups, and the rollouts that carried them.
    (prompts,) = [m for m in archived(run_dir, PromptBatch) if m.step == update - 1]
    assert answer["prompt_rows"] == sorted(int(i) for i in prompts.prompt_index)
    (rollouts,) = [m for m in archived(run_dir, RolloutBatch) if m.step == update - 1]
    assert answer["token_versions"] == {str(update - 1): int(rollouts.response_lengths.sum())}
    assert answer["generators"] == ["generator-0"] and answer["scorers"] == ["scorer-0"]
    assert answer["rewards"] == [f"reward.function={config.reward.function}"]
    assert {r.split(":")[0] for r in answer["records"]} == {"prompts", "rollouts", "scored", "experience"}
    # The reverse: a prompt of that batch, the update that trained its group.
    row = int(prompts.prompt_index[3])
    reverse = json.loads(streamppo("trace", "--log", str(run_dir / "log"), "--prompt", str(row), "--json").stdout)
    assert reverse["groups"][group_key(update - 1, 3)] == update and update in reverse["updates"]
    # Each group's reward: its responses' scores as trained on (the scored records, read here independently).
    (scored,) = [m for m in archived(run_dir, ScoredBatch) if m.step == update - 1]
    for group in answer["groups"]:
        row = int(group["group"].split("/")[1])
        assert group["scores"] == pytest.approx(scored.scores[scored.group_index == row].tolist())
    text = streamppo("trace", "--log", str(run_dir / "log"), "--update", str(update)).stdout
    # Updates count from 1, steps from 0: the text says both, and each group's reward.
    assert text.startswith(f"update {update} (updates count from 1): {len(line['groups'])} groups of prompt batches")
    assert f"[{update - 1}] (steps count from 0" in text.splitlines()[0]
    first = answer["groups"][0]
    assert f"{first['group']} (dataset row {first['prompt_row']}) reward {first['reward']:.4g} over" in text
    assert f"      prompt: {first['prompt']!r}" in text, "each group's prompt text, as docs/log.md says"


def test_the_score_comparison_is_right_on_a_hand_made_case():
    assert average_ranks(np.array([10.0, 30.0, 20.0, 20.0])).tolist() == [1.0, 4.0, 2.5, 2.5]
    reversed_order = compare_scores(np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.4, 0.3, 0.2, 0.1]))
    assert reversed_order["spearman"] == pytest.approx(-1.0) and reversed_order["pearson"] == pytest.approx(-1.0)
    assert reversed_order["rank_shift"] == pytest.approx([0.75, 0.25, -0.25, -0.75])
    # Monotone but not linear: Spearman 1, Pearson below it.
    monotone = compare_scores(np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 2.0, 3.0, 100.0]))
    assert monotone["spearman"] == pytest.approx(1.0) and monotone["pearson"] < 0.9
    # Ties: old (1, 1, 2) ranks (1.5, 1.5, 3); new (3, 2, 1): Pearson of those ranks.
    tied = compare_scores(np.array([1.0, 1.0, 2.0]), np.array([3.0, 2.0, 1.0]))
    assert tied["spearman"] == pytest.approx(np.corrcoef([1.5, 1.5, 3.0], [3.0, 2.0, 1.0])[0, 1])
    assert compare_scores(np.array([1.0, 1.0]), np.array([0.0, 1.0]))["spearman"] is None, "constant side"


@shares_the_run
@pytest.mark.parametrize("given", ["run config", "reward section", "reward keys"])
def test_rescore_scores_the_retained_responses_with_another_reward_and_compares(archived_run, tmp_path, given):
    """The new reward from a whole run config (with --reward-set), or from a file of the reward section alone."""
    config, run_dir = archived_run
    out = tmp_path / "rescore"
    new_reward = {"function": "tests.services.ops.test_runlog:response_letters"}
    reward_file = tmp_path / "reward.yaml"
    reward_file.write_text(yaml.safe_dump({"reward": new_reward} if given == "reward section" else new_reward))
    reward_args = (
        ["--reward-config", str(REPO / "examples" / "vowels" / "config.yaml"), "--reward-set",
         "reward.function=tests.services.ops.test_runlog:response_letters"]
        if given == "run config"
        else ["--reward-config", str(reward_file)]
    )  # fmt: skip
    streamppo("rescore", "--log", str(run_dir / "log"), *reward_args, "--out", str(out))
    rows = [json.loads(line) for line in (out / "rescore.jsonl").read_text().splitlines()]
    scored = archived(run_dir, ScoredBatch)
    assert len(rows) == sum(len(m.response_text) for m in scored)
    old = {(m.batch_id, m.response_text[i]): float(m.scores[i]) for m in scored for i in range(len(m.response_text))}
    for row in rows:
        assert row["new"] == len(row["response"]), "the new reward, applied to the retained text"
        assert row["old"] == pytest.approx(old[(row["batch_id"], row["response"])])
        assert row["old_reward"] == {"reward.function": config.reward.function}
    summary = json.loads((out / "summary.json").read_text())
    expected = compare_scores(np.array([r["old"] for r in rows]), np.array([r["new"] for r in rows]))
    assert summary["spearman"] == pytest.approx(expected["spearman"])
    assert summary["new_reward"] == {"reward.function": "tests.services.ops.test_runlog:response_letters"}
    report = (out / "report.md").read_text()
    worst = max(rows, key=lambda r: abs(r["rank_shift"]))
    assert f"{worst['rank_shift']:+.3f}" in report.split("## Largest disagreements")[1].splitlines()[4]


def test_referenced_batches_are_kept_for_their_topic_s_retention_then_expire(tmp_path, make_config):
    import os
    import time

    from services.feeder.service import FeederService

    feeder = FeederService(make_config())
    payloads = [(feeder.batch(step), encode(feeder.batch(step))) for step in range(3)]
    budget = int(2.5 * max(len(p) for _, p in payloads))  # two files fit, not three
    config = make_config(f"kafka.retention.topics={{prompts: {{hours: 1, bytes: {budget}}}}}", "kafka.partitions=1")
    store = BatchStore(tmp_path / "store", retention=config.batch_retention)
    references = []
    for batch, payload in payloads:
        references.append(store.put(batch, payload))
        time.sleep(0.01)  # distinct modification times: the oldest goes first
    assert [Path(r.uri).exists() for r in references] == [False, True, True], "the oldest beyond the bytes went"
    now = time.time()
    os.utime(references[1].uri, (now - 7200, now - 7200))  # two hours old: past its hour
    assert store.expire("prompts", now=now) == [Path(references[1].uri)]
    assert Path(references[2].uri).exists()
    assert config.batch_retention("rollouts") == (168 * 3600, None), "the default: Kafka's 7 days"


@pytest.mark.slow
def test_the_learner_feeds_mlflow_wandb_and_tensorboard_and_they_read_back(make_config, tmp_path):
    """The real libraries: MLflow's local database read back through its client, W&B's offline run file parsed,
    TensorBoard's events through its reader."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from services.launch.embedded import run_embedded

    config = make_config("run.steps=2", "run.trackers=[mlflow,wandb,tensorboard]", "data.eval_prompts=0")
    run_embedded(config, progress=False)
    run_dir = config.run.dir
    lines = metrics(run_dir)
    ids = json.loads((run_dir / "trackers.json").read_text())

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.data.params["run.run_id"] == config.run.run_id
    assert run.data.params["algorithm.kl_coef"] == str(config.algorithm.kl_coef)
    history = client.get_metric_history(ids["mlflow"], "reward_mean")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["reward_mean"])) for r in lines]
    artifacts = {a.path for a in client.list_artifacts(ids["mlflow"], "final/actor")}
    assert "final/actor/config.json" in artifacts
    assert "report/reward.png" in {a.path for a in client.list_artifacts(ids["mlflow"], "report")}

    (run_file,) = (run_dir / "wandb").glob(f"offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb")
    records = wandb_records(run_file)
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    rows = [(h.step.num, {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in h.item}) for h in history]
    assert [(step, row["reward_mean"]) for step, row in rows] == [
        (r["step"], pytest.approx(r["reward_mean"])) for r in lines
    ]
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    logged = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert logged["run"]["run_id"] == config.run.run_id and logged["algorithm"] == config.algorithm.model_dump()
    assert any(r.WhichOneof("record_type") == "artifact" for r in records), "the final models as an artifact"

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("reward_mean")]
    assert scalars == [(r["step"], pytest.approx(r["reward_mean"])) for r in lines]


def wandb_records(path: Path) -> list:
    """The records of a W&B run file: LevelDB's log format (32 KiB blocks of checksummed chunks) after a 7-byte
    W&B header, each record a ``wandb_internal_pb2.Record``. wandb 0.31 ships no Python reader of its own."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "a W&B run file"
    block, records, pending, position = 32768, [], b"", 7
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_a_tracker_whose_library_is_missing_is_named_before_anything_starts(make_config, monkeypatch):
    """A library that is not installed cannot be had for real in this environment: find_spec answers None."""
    import importlib.util

    from common.config import ConfigError
    from services.launch.preflight import check_run_inputs

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"run.trackers: not installed here: wandb \(pip install wandb\)"):
        check_run_inputs(make_config("run.trackers=[mlflow,wandb]"))


@shares_the_run
def test_a_replay_reproduces_every_version_s_digest_from_the_start_and_from_a_checkpoint(archived_run, tmp_path):
    _, run_dir = archived_run
    result = streamppo("replay", "--log", str(run_dir / "log"), "--out", str(tmp_path / "a"))
    checked = [line for line in result.stdout.splitlines() if line.startswith("v")]
    assert len(checked) == 2 * STEPS and all(": same blake3:" in line for line in checked), result.stdout
    announced = {(line["step"], model): d for line in metrics(run_dir) for model, d in line["digests"].items()}
    assert f"v{STEPS} actor: same {announced[(STEPS, 'actor')]}" in checked
    checkpoints = {int(c.name.split("-")[1]): c for c in (run_dir / "checkpoints").glob("ckpt-*")}
    start = max(version for version in checkpoints if version < STEPS)  # one with an update after it
    checkpoint = checkpoints[start]
    result = streamppo(
        "replay", "--log", str(run_dir / "log"), "--out", str(tmp_path / "b"), "--from-checkpoint", str(checkpoint)
    )
    assert f"replayed v{start + 1}..v{STEPS}: every digest as announced" in result.stdout


@shares_the_run
def test_a_replay_detects_an_altered_experience_record(archived_run, tmp_path):
    """The record of step 1 rewritten whole (a valid message, inline, one advantage changed): replay still runs, and
    the first version it trained differs from the run's."""
    from common.log_archive import ArchivedRecord, LogArchiveWriter

    _, run_dir = archived_run
    original = ArchiveReader.open(run_dir / "log")
    altered = LogArchiveWriter(tmp_path / "log", original.archive.run_id, original.archive.identity)
    for topic in original.archive.topics():
        altered.add_topic(topic, original.archive.manifest["topics"][topic]["partitions"])
        if topic == "experience":
            for record, message in original.messages(ExperienceBatch):
                if message.step == 1:
                    message.advantages[0, 0] += 0.5
                value = encode(message)
                altered.append(ArchivedRecord(topic, record.partition, record.offset, record.key, value, 0.0))
            continue
        for record in original.archive.records(topic):
            altered.append(record)
            reference = batch_reference(record.value)
            if reference is not None:
                altered.keep_batch_file(original.archive.batch_file(reference.uri))
    altered.close()
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "replay", "--log", str(tmp_path / "log"), "--run-dir", str(run_dir)]
        + ["--out", str(tmp_path / "replay")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    trained = {group: r["step"] for r in metrics(run_dir) for group in r["groups"]}
    first = trained[group_key(1, 0)]
    assert f"replay differs from the run from v{first} (actor" in result.stderr
    assert all(": same " in line for line in result.stdout.splitlines() if line.startswith(f"v{first - 1} "))


def test_the_largest_disagreements_come_first_ties_last_and_no_move_is_none():
    from services.ops.runlog.rescore import largest_disagreements

    rows = [
        {"id": "alone", "old": 0.9, "new": 0.1, "rank_shift": -0.5},
        {"id": "tied-a", "old": 1.0, "new": 0.0, "rank_shift": 0.5},
        {"id": "tied-b", "old": 1.0, "new": 0.0, "rank_shift": -0.5},
        {"id": "small", "old": 0.2, "new": 0.3, "rank_shift": 0.1},
        {"id": "still", "old": 0.5, "new": 0.5, "rank_shift": 0.0},
    ]
    assert [r["id"] for r in largest_disagreements(rows)] == ["alone", "tied-a", "tied-b", "small"]
