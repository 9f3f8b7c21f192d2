"""A fleet replica serving several runs: each run's records handled by its own runner, turns fair by share, runs
added and removed while the others go on."""

import os

import pytest
import yaml
from conftest import EXAMPLE
from helpers import publish, read_messages

from common.schema import ScoredBatch, encode
from services.feeder import FeederService
from services.fleet import Fleet, RunsFolder, parse_shares
from services.generator import GeneratorService
from services.roles import pipeline_topics
from services.transport import MemoryBus
from services.transport.namespaced import NamespacedBus


@pytest.fixture
def broker():
    return MemoryBus()  # one broker; each run in its own namespace on it


def run_config(make_config, tmp_path, run_id):
    return make_config(
        f"run.run_id={run_id}",
        f"run.dir={tmp_path / run_id}",
        "data.batch_size=2",
        "generation.n=2",
        "generation.max_new_tokens=4",
        "learner.mini_batch_size=4",
    )


def bus_of(broker):
    def make(config):
        bus = NamespacedBus(broker, config.namespace)
        bus.create_topics(pipeline_topics(partitions=1))
        return bus

    return make


def rollouts(config, steps):
    """The run's rollout records of prompt batches ``0 .. steps−1``, as its generator sends them."""
    feeder, generator = FeederService(config), GeneratorService(config)
    return [encode(generator.process(feeder.batch(step))[0]) for step in range(steps)]


def scored(broker, config) -> list[ScoredBatch]:
    return read_messages(NamespacedBus(broker, config.namespace), "scored")


def test_a_flooding_run_gets_its_share_of_a_scorer_fleet_and_the_other_run_is_not_starved(
    broker, make_config, tmp_path
):
    """Run a floods the fleet with 12 batches, run b sends 4. With equal shares b's are done while a has done about
    as many (a first-come order would have done all of a's first); with a's share 3 to b's 1, a does about three for
    each of b's."""
    a, b = (run_config(make_config, tmp_path, run_id) for run_id in ("a", "b"))
    flood, few = rollouts(a, 12), rollouts(b, 4)
    for share_a, most in ((1.0, 8), (3.0, 12)):
        broker = MemoryBus()
        fleet = Fleet("scorer", bus_of(broker))
        fleet.add(a, share_a)
        fleet.add(b)
        publish(NamespacedBus(broker, "a"), "rollouts", *flood)
        publish(NamespacedBus(broker, "b"), "rollouts", *few)
        while len(scored(broker, b)) < 4:
            assert fleet.poll_once(), "a run has work left"
        done_a = len(scored(broker, a))
        if share_a == 1.0:
            assert 2 <= done_a <= most, f"equal shares: a did {done_a} while b did 4"
        else:
            assert done_a >= 8, f"a's share is 3: a did {done_a} while b did 4"
        shares = fleet.shares()
        assert shares["a"]["share_fraction"] == round(share_a / (share_a + 1), 4)
        while fleet.poll_once():
            pass
        assert len(scored(broker, a)) == 12, "and then a has the replica to itself"
        fleet.close()


def test_runs_come_and_go_without_touching_the_others_and_never_take_each_others_records(broker, make_config, tmp_path):
    a, b, c = (run_config(make_config, tmp_path, run_id) for run_id in ("a", "b", "c"))
    fleet = Fleet("scorer", bus_of(broker), replica_id="scorer-fleet-0")
    fleet.add(a)
    fleet.add(b)
    with pytest.raises(ValueError, match="serves run a already"):
        fleet.add(a)
    of_a, of_b = rollouts(a, 2), rollouts(b, 2)
    publish(NamespacedBus(broker, "a"), "rollouts", *of_a, of_b[0])  # one of b's records lands in a's topic
    publish(NamespacedBus(broker, "b"), "rollouts", of_b[1])
    while fleet.poll_once():
        pass
    assert [m.step for m in scored(broker, a)] == [0, 1] and [m.step for m in scored(broker, b)] == [1]
    assert fleet.runs["a"].runner.counters["other_runs"] == 1, "b's record in a's topic is skipped, not scored as a's"
    fleet.remove("a")
    fleet.add(c)
    publish(NamespacedBus(broker, "a"), "rollouts", *rollouts(a, 3)[2:])  # a is no longer served here
    publish(NamespacedBus(broker, "c"), "rollouts", *rollouts(c, 1))
    while fleet.poll_once():
        pass
    assert [m.step for m in scored(broker, a)] == [0, 1] and [m.step for m in scored(broker, c)] == [0]
    assert all(m.producer == "scorer-fleet-0" for m in scored(broker, c))
    fleet.close()


def test_the_runs_folder_says_which_runs_came_and_went(tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    example = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    for run_id in ("a", "b"):
        config = {**example, "run": {**example.get("run", {}), "run_id": run_id}}
        config["data"] = {**config["data"], "prompts": str(EXAMPLE / config["data"]["prompts"])}
        (folder / f"{run_id}.yaml").write_text(yaml.safe_dump(config))
    runs = RunsFolder(folder)
    added, removed = runs.changes()
    assert [config.run.run_id for config in added] == ["a", "b"] and removed == []
    (folder / "a.yaml").unlink()
    assert runs.changes() == ([], ["a"])
    runs.not_served("b", "ModelLoadError: no such model")  # its run could not be served
    assert runs.errors() == [(folder / "b.yaml", "ModelLoadError: no such model")] and runs.errors() == []
    assert runs.changes() == ([], []), "not tried again while the file is as it was"
    os.utime(folder / "b.yaml", (1, 1))
    assert [config.run.run_id for config in runs.changes()[0]] == ["b"], "tried again once it changed"
    (folder / "c.yaml").write_text("run: [")
    assert runs.changes() == ([], []) and "c.yaml" in str(runs.errors())
    assert parse_shares(["a=3", "b=0.5"]) == {"a": 3.0, "b": 0.5}
    with pytest.raises(ValueError, match="RUN_ID=WEIGHT"):
        parse_shares(["a=0"])


def test_a_fleet_serves_only_roles_that_serve_until_stopped():
    with pytest.raises(ValueError, match="not the learner"):
        Fleet("learner", lambda config: None)


@pytest.mark.slow
def test_three_runs_on_shared_fleets_survive_kill_9_of_a_fleet_replica_and_of_one_runs_learner(
    own_broker, tmp_path, model_cache
):
    """Over a real broker: `streamppo fleet generator` and `streamppo fleet scorer` serve three LoRA runs whose configs
    are in one folder (the generator replica holds one base model and an adapter per run); each run has its own
    feeder, advantage service and learner. Mid-run the generator fleet is killed
    (kill -9) and started again, and so is run b's learner. Each run trains every group of its prompt batches exactly
    once, in its own namespace."""
    import json
    import signal
    import subprocess
    import sys
    import time
    import uuid

    from conftest import REPO
    from helpers import assert_each_group_once, run_settings

    from common.config import load_config
    from services.cluster import stop_all

    steps, runs = 6, tmp_path / "runs"
    runs.mkdir()
    run_ids = {name: f"fleet-{name}-{uuid.uuid4().hex[:6]}" for name in ("a", "b", "c")}
    for run_id in run_ids.values():
        settings = [
            *run_settings(tmp_path / run_id, model_cache, steps, run_id),
            "generation.backend=transformers",
            "data.eval_prompts=0",
            "model.lora={rank: 4, target_modules: [q_proj, v_proj]}",  # one base model for the three runs
            *own_broker,
        ]
        config = load_config(EXAMPLE / "config.yaml", settings)
        (runs / f"{run_id}.yaml").write_text(config.model_dump_json(indent=2, exclude_unset=True))
    processes, logs = {}, {}

    def start(name, *args):
        logs[name] = tmp_path / f"{name}.log"
        with open(logs[name], "a") as out:
            command = [sys.executable, "-m", "services.cli", "-v", *args]
            processes[name] = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    def updates(run_id):
        metrics = tmp_path / run_id / "run" / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def fleet(role):
        start(f"{role}-fleet", "fleet", role, "--runs", str(runs), "--replica-id", f"{role}-fleet")

    def learner(run_id):
        start(f"learner-{run_id}", "learner", "--config", str(runs / f"{run_id}.yaml"))

    try:
        for role in ("generator", "scorer"):
            fleet(role)
        for run_id in run_ids.values():
            for role in ("feeder", "advantage"):
                start(f"{role}-{run_id}", role, "--config", str(runs / f"{run_id}.yaml"))
            learner(run_id)
        deadline = time.monotonic() + 300
        while updates(run_ids["b"]) < 2:
            assert time.monotonic() < deadline, logs[f"learner-{run_ids['b']}"].read_text()[-3000:]
            time.sleep(0.2)
        processes["generator-fleet"].send_signal(signal.SIGKILL)
        processes["generator-fleet"].wait()
        fleet("generator")
        processes[f"learner-{run_ids['b']}"].send_signal(signal.SIGKILL)
        processes[f"learner-{run_ids['b']}"].wait()
        learner(run_ids["b"])
        for run_id in run_ids.values():
            name = f"learner-{run_id}"
            assert processes[name].wait(timeout=600) == 0, logs[name].read_text()[-3000:]
    finally:
        stop_all(list(processes.values()))
    for run_id in run_ids.values():
        records = [json.loads(line) for line in (tmp_path / run_id / "run" / "metrics.jsonl").open()]
        assert [r["step"] for r in records] == list(range(1, steps + 1)), f"{run_id}: every version applied once"
        assert_each_group_once(records, run_id, steps)
        for role in ("generator", "scorer"):
            assert f"serving run {run_id}" in logs[f"{role}-fleet"].read_text()
    assert "resumed from checkpoint" in logs[f"learner-{run_ids['b']}"].read_text()
    assert "3 adapter(s) share its base weights" in logs["generator-fleet"].read_text(), "one base, an adapter a run"
