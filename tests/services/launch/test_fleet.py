"""A fleet replica serving several runs: each run's records handled by its own runner, turns fair by share, runs
added and removed while the others go on."""

import itertools
import os

import pytest
import yaml
from conftest import EXAMPLE
from helpers import publish, read_messages

from common.models import FrozenModels
from common.schema import ScoredBatch, decode, encode
from services.feeder import FeederService
from services.generator import GeneratorService
from services.launch.fleet import Fleet, RunsFolder, parse_shares
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
    each of b's. Every turn costs one tick of the fleet's clock here (on a real one, the seconds it took: this
    machine's speed would decide the counts)."""
    a, b = (run_config(make_config, tmp_path, run_id) for run_id in ("a", "b"))
    flood, few = rollouts(a, 12), rollouts(b, 4)
    for share_a, fewest, most in ((1.0, 3, 5), (3.0, 9, 12)):
        broker = MemoryBus()
        ticks = itertools.count()
        fleet = Fleet("scorer", bus_of(broker), now=lambda ticks=ticks: next(ticks) / 2)  # read twice a turn
        fleet.add(a, share_a)
        fleet.add(b)
        publish(NamespacedBus(broker, "a"), "rollouts", *flood)
        publish(NamespacedBus(broker, "b"), "rollouts", *few)
        while len(scored(broker, b)) < 4:
            assert fleet.poll_once(), "a run has work left"
        done_a = len(scored(broker, a))
        assert fewest <= done_a <= most, f"a's share {share_a} to b's 1: a did {done_a} while b did 4"
        shares = fleet.shares()
        assert shares["a"]["share_fraction"] == round(share_a / (share_a + 1), 4)
        while fleet.poll_once():
            pass
        assert len(scored(broker, a)) == 12, "and then a has the replica to itself"
        fleet.close()


def test_a_run_over_its_quota_waits_for_it_while_the_other_run_goes_on(make_config, tmp_path):
    """Run a may score at most 16 response tokens/s (about one of its batches a second, a second's worth at once):
    with the clock stopped it does what its bucket holds and then waits while b is served; each second the clock
    moves, it does about a second's worth more. Both have more work than they can do meanwhile."""
    a, b = (run_config(make_config, tmp_path, run_id) for run_id in ("a", "b"))
    flood = rollouts(a, 12)
    tokens_per_batch = sum(decode(record).response_tokens_total for record in flood) / len(flood)
    clock = [100.0]
    broker = MemoryBus()
    fleet = Fleet("scorer", bus_of(broker), now=lambda: clock[0])
    quota = 16.0
    fleet.add(a, quota=quota)
    fleet.add(b)
    publish(NamespacedBus(broker, "a"), "rollouts", *flood)
    publish(NamespacedBus(broker, "b"), "rollouts", *rollouts(b, 12))
    for _ in range(8):
        assert fleet.poll_once()
    first = len(scored(broker, a))
    assert 1 <= first <= quota / tokens_per_batch + 1, f"a's first second: {first} batches"
    assert len(scored(broker, b)) == 8 - first, "the turns a may not take are b's"
    for second in range(1, 4):
        clock[0] += 1.0
        for _ in range(4):
            fleet.poll_once()
        done = len(scored(broker, a))
        assert done <= (second + 1) * quota / tokens_per_batch + 1, f"after {second} s a did {done} batches"
        assert done > first, "the clock moved: a's quota lets it go on"
        first = done
    shares = fleet.shares()
    assert shares["a"]["quota_tokens_per_s"] == quota and shares["b"]["quota_tokens_per_s"] is None
    assert shares["a"]["tokens"] == sum(m.response_tokens_total for m in scored(broker, a))
    assert fleet.status_counters("a")["fleet.quota_tokens_per_s"] == quota
    with pytest.raises(ValueError, match="quota must be above 0"):
        fleet.add(run_config(make_config, tmp_path, "c"), quota=0.0)
    fleet.close()


def test_a_fleets_metrics_and_status_say_each_runs_share(make_config, tmp_path):
    """/metrics of a fleet's replica: each run's series with its run label, and each run's share; each run's status
    report says what share of the replica it has and used, and ``streamppo status`` prints it."""
    from prometheus_client import generate_latest

    from common.schema import ReplicaStatus
    from services.ops.status import PipelineStatus, format_status
    from services.runtime.metrics import FleetMetrics

    a, b = (run_config(make_config, tmp_path, run_id) for run_id in ("a", "b"))
    broker = MemoryBus()
    fleet = Fleet("scorer", bus_of(broker), replica_id="scorer-fleet-0")
    fleet.add(a, 3.0)
    fleet.add(b)
    publish(NamespacedBus(broker, "a"), "rollouts", *rollouts(a, 3))
    publish(NamespacedBus(broker, "b"), "rollouts", *rollouts(b, 1))
    while fleet.poll_once():
        pass
    metrics = FleetMetrics("scorer", lambda: {r: run.runner.metrics for r, run in fleet.runs.items()}, fleet.shares)
    text = generate_latest(metrics.registry).decode()
    assert 'streamppo_batches_total{outcome="processed",role="scorer",run="a"} 3.0' in text
    assert 'streamppo_batches_total{outcome="processed",role="scorer",run="b"} 1.0' in text
    assert 'streamppo_fleet_share{role="scorer",run="a"} 3.0' in text
    assert 'streamppo_fleet_share_fraction{role="scorer",run="b"} 0.25' in text
    assert 'streamppo_fleet_runs{role="scorer"} 2.0' in text
    assert "streamppo_fleet_quota_tokens_per_second{" not in text, "no run has a quota"
    used = fleet.shares()["a"]["seconds_fraction"]
    assert 0 < used < 1
    report = fleet.runs["a"].runner.publish_status(counters=fleet.status_counters("a"))
    assert report.counters["fleet.share_fraction"] == 0.75 and report.counters["fleet.runs"] == 2
    published = read_messages(NamespacedBus(broker, "a"), "status")
    assert isinstance(published[-1], ReplicaStatus) and published[-1].counters["fleet.share"] == 3.0
    table = format_status(PipelineStatus("a", replicas={report.replica: report}))
    assert f"fleet replica of 2 run(s): this run's share 3 (75% of the shares), used {used:.0%}" in table
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
    reference, key = fleet.runs["a"].runner.service.reference, fleet.runs["a"].runner.service.reference_key
    assert fleet.runs["b"].runner.service.reference is reference, "the runs' frozen reference: one copy"
    users = FrozenModels._models[key][1]  # a and b (and any other test's scorer in this process)
    fleet.remove("a")
    fleet.add(c)
    publish(NamespacedBus(broker, "a"), "rollouts", *rollouts(a, 3)[2:])  # a is no longer served here
    publish(NamespacedBus(broker, "c"), "rollouts", *rollouts(c, 1))
    while fleet.poll_once():
        pass
    assert [m.step for m in scored(broker, a)] == [0, 1] and [m.step for m in scored(broker, c)] == [0]
    assert all(m.producer == "scorer-fleet-0" for m in scored(broker, c))
    assert fleet.runs["c"].runner.service.reference is reference, "kept while a run uses it"
    fleet.close()
    assert FrozenModels._models.get(key, [None, 0])[1] == users - 2, "each run lets its use go"


def test_the_runs_folder_says_which_runs_came_and_went(tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    example = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    for run_id in ("a", "b"):
        config = {**example, "run": {**example.get("run", {}), "run_id": run_id}}
        config["data"] = {**config["data"], "prompts": str(EXAMPLE / config["data"]["prompts"])}
        (folder / f"{run_id}.yaml").write_text(yaml.safe_dump(config))
    clock = [0.0]
    runs = RunsFolder(folder, retry_s=30.0, now=lambda: clock[0])
    added, removed = runs.changes()
    assert [config.run.run_id for config in added] == ["a", "b"] and removed == []
    (folder / "a.yaml").unlink()
    assert runs.changes() == ([], ["a"])
    runs.not_served("b", "ModelLoadError: no such model")  # its run could not be served
    said = "ModelLoadError: no such model (tried again in 30 s, or once it changes)"
    assert runs.errors() == [(folder / "b.yaml", said)] and runs.errors() == []
    os.utime(folder / "b.yaml", (1, 1))
    clock[0] = 29.0
    assert runs.changes() == ([], []), "not tried again while the file says what it said, within its 30 s"
    clock[0] = 30.0  # a fault that passes (a broker that did not answer the fleet at start) costs a run 30 s
    assert [config.run.run_id for config in runs.changes()[0]] == ["b"], "tried again after 30 s"
    runs.not_served("b", "ModelLoadError: no such model")
    with open(folder / "b.yaml", "a") as file:
        file.write("# the model is there now\n")
    assert [config.run.run_id for config in runs.changes()[0]] == ["b"], "tried again at once when it changed"
    config = yaml.safe_load((folder / "b.yaml").read_text())
    config["run"]["steps"] = 7
    (folder / "b.yaml").write_text(yaml.safe_dump(config))
    added, removed = runs.changes()
    assert removed == ["b"] and [c.run.steps for c in added] == [7], "a run whose file changed: let go, taken up anew"
    assert runs.changes() == ([], [])
    (folder / "c.yaml").write_text("run: [")
    assert runs.changes() == ([], []) and "c.yaml" in str(runs.errors())
    clock[0] = 1e9
    assert runs.changes() == ([], []), "a file that does not load: tried again only once it changes"
    assert parse_shares(["a=3", "b=0.5"]) == {"a": 3.0, "b": 0.5}
    with pytest.raises(ValueError, match="RUN_ID=WEIGHT"):
        parse_shares(["a=0"])


def test_a_fleet_serves_only_roles_that_serve_until_stopped():
    with pytest.raises(ValueError, match="not the learner"):
        Fleet("learner", lambda config: None)


@pytest.mark.slow
def test_two_runs_on_shared_fleets_survive_kill_9_of_a_fleet_replica_and_of_one_runs_learner(
    own_broker, tmp_path, model_cache
):
    """Over a real broker: `streamppo fleet generator` and `streamppo fleet scorer` serve two LoRA runs whose configs
    are in one folder (the generator replica holds one base model and an adapter per run); each run has its own
    feeder, advantage service and learner. Mid-run the generator fleet is killed
    (kill -9) and started again, and so is run b's learner. Each run trains every group of its prompt batches exactly
    once, in its own namespace."""
    import json
    import signal
    import subprocess
    import sys
    import time
    import urllib.request
    import uuid

    from conftest import REPO
    from helpers import assert_each_group_once, run_settings

    from common.config import load_config
    from services.launch.cluster import stop_all
    from services.transport.brokers.local_broker import free_port

    steps, runs = 6, tmp_path / "runs"
    runs.mkdir()
    run_ids = {name: f"fleet-{name}-{uuid.uuid4().hex[:6]}" for name in ("a", "b")}
    for run_id in run_ids.values():
        settings = [
            *run_settings(tmp_path / run_id, model_cache, steps, run_id),
            "generation.backend=transformers",
            "data.eval_prompts=0",
            "model.lora={rank: 4, target_modules: [q_proj, v_proj]}",  # one base model for both runs
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

    port = free_port()

    def fleet(role):
        metrics = ["--metrics-port", str(port)] if role == "generator" else []
        start(f"{role}-fleet", "fleet", role, "--runs", str(runs), "--replica-id", f"{role}-fleet", *metrics)

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
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            scraped = response.read().decode()
        for run_id in run_ids.values():  # every run's series and share, from the one replica
            assert f'streamppo_fleet_share_fraction{{role="generator",run="{run_id}"}} 0.5' in scraped, scraped
            assert f'streamppo_batches_total{{outcome="processed",role="generator",run="{run_id}"}}' in scraped
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
    status = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--config", str(runs / f"{run_ids['a']}.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "fleet replica of 2 run(s): this run's share 1 (50% of the shares)" in status.stdout, status.stdout
    assert "2 adapter(s) share its base weights" in logs["generator-fleet"].read_text(), "one base, an adapter a run"


def test_a_fleet_replica_stopped_while_its_broker_is_away_exits_in_seconds(make_config, tmp_path):
    """A scorer fleet serving a run whose broker went away: on SIGTERM it exits 0 once its stop has waited the bounded
    time for the broker (its run's record not committed comes again), not the clients' timeouts."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    from services.launch.host import STOP_BROKER_S
    from services.transport.brokers.local_broker import LocalBroker, free_port

    port = free_port()
    runs = tmp_path / "runs"
    runs.mkdir()
    config = run_config(make_config, tmp_path, "away")
    settings = {"kafka": {"bootstrap": f"127.0.0.1:{port}", "idempotent_producer": False}}
    (runs / "away.yaml").write_text(
        yaml.safe_dump(yaml.safe_load(config.model_dump_json(exclude_unset=True)) | settings)
    )
    broker = LocalBroker(port, log_path=tmp_path / "broker.log").start()
    log = tmp_path / "fleet.log"
    command = [sys.executable, "-m", "services.cli", "-v", "fleet", "scorer", "--runs", str(runs)]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "serving run away" not in log.read_text():
            assert time.monotonic() < deadline and process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        broker.stop()
        time.sleep(8)  # its turns now wait on a broker that does not answer
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
        print(f"exited {time.monotonic() - signalled:.1f} s after SIGTERM")
        assert f"the broker did not answer within {STOP_BROKER_S:.0f} s of stopping" in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
        broker.stop()
