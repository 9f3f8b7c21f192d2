"""Long runs of processes over a real broker: a judge, a broker replaced mid-run, runs sharing a broker, random
kill -9 across every role, a two-rank learner losing a rank."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO
from helpers import (
    assert_each_group_once,
    run_settings,
)
from processes import (
    archived_and_traced,
    run_messages,
    run_up,
    start_up,
    unique,
    up_on_a_broker_of_its_own,
)

from services.transport.brokers.local_broker import free_port

pytestmark = pytest.mark.slow  # services as processes and a broker per test where it needs one


@pytest.mark.slow
@pytest.mark.soak
def test_a_judge_scores_a_run_over_the_broker(own_broker, make_config, tmp_path, model_cache):
    """`reward.judge`: the scorer process runs SmolLM2-135M-Instruct (no good judge, a real one) on each answer and
    parses its number; the run trains on the judge's scores, and every scored batch names its judge and how many of
    its answers got the default score; archive and trace name the judge. (make test: the same judge in process in
    test_judge.py, and the scorer's path over the broker in every run of processes.)"""
    steps, run_id = 2, unique("judge")
    judge = "{model: builtin:smollm2-135m-instruct, backend: transformers, max_new_tokens: 4}"
    overrides = [
        "reward.function=null",
        f"reward.judge={judge}",
        "generation.backend=transformers",
        "data.batch_size=4",
        "generation.n=2",
        "learner.mini_batch_size=8",
    ]
    run_up(own_broker, tmp_path, model_cache, steps, run_id, overrides)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(records) == steps
    scored = run_messages(make_config(*own_broker), "scored", run_id, steps)
    assert len(scored) == steps
    for message in scored.values():
        assert message.lineage["reward.judge"].startswith(str(model_cache / "models" / "smollm2-135m-instruct"))
        assert 0 <= message.lineage["reward.judge.unparsed"] <= len(message.scores)
        assert "reward.function" not in message.lineage
    # The learner trained on what the judge gave: each update's mean reward is its batch's mean score.
    by_step = {m.step: float(m.scores.mean()) for m in scored.values()}
    assert [r["reward_mean"] for r in records] == pytest.approx([by_step[s] for s in sorted(by_step)], abs=1e-6)
    # The run's log outlives its broker, with the judge named in what made an update.
    made = archived_and_traced(tmp_path, [*run_settings(tmp_path, model_cache, steps, run_id), *overrides, *own_broker])
    assert made["groups"] and [g["group"] for g in made["groups"]] == records[1]["groups"]
    assert made["rewards"] == [f"reward.judge={scored[records[1]['batch_ids'][0]].lineage['reward.judge']}"]
    assert made["generators"] == ["generator-0"] and made["scorers"] == ["scorer-0"]


@pytest.mark.slow
@pytest.mark.soak
def test_a_broker_replaced_mid_run_costs_seconds_and_no_operator_and_resume_finishes_it(tmp_path, model_cache):
    """The broker dies and an empty one takes its place. Nobody acting, the services notice and go on on the new log
    in their processes, models kept: the learner checkpoints first and announces on the new log, the feeder publishes
    again from the first prompt batch that announcement says is not settled, and no process is started again. Then the
    stall an independent check found: services that lived on the new broker a while are stopped by an operator, who
    runs `up --resume` on that same broker; groups and offsets there belong to the logs they were made on (groups are
    named after the log), and the run finishes with every version applied exactly once. Mid-stream: the generator
    streams records of 4 groups, and an update takes 8 groups, half a prompt batch, so prompt batches are settled in
    part when the broker goes, and no group is lost or repeated."""
    from common.checkpoint import load_latest_checkpoint
    from services.transport.brokers.local_broker import LocalBroker, free_port

    steps, run_id, port = 16, unique("loss"), free_port()
    prompt_batches = steps * 8 // 16  # updates × groups per update, in batches of 16 prompts
    broker = LocalBroker(port, log_path=tmp_path / "broker-1.log").start()
    metrics = tmp_path / "run" / "metrics.jsonl"
    streaming = ("generation.streaming=true", "generation.groups_per_record=4", "learner.groups_per_update=8")
    roles = ("feeder", "generator", "scorer", "advantage", "learner")

    def up(log_name, *up_args):
        return up_on_a_broker_of_its_own(
            tmp_path, model_cache, steps, run_id, port, log_name, *up_args, settings=streaming
        )

    def lines():
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def went_on(role):
        return re.search(rf"{role}-0: .*going on on the new log", (tmp_path / "up-1.log").read_text()) is not None

    first = up("up-1.log")
    try:
        deadline = time.monotonic() + 300
        while lines() < 4:
            assert time.monotonic() < deadline and first.poll() is None, (tmp_path / "up-1.log").read_text()[-3000:]
            time.sleep(0.2)
        broker.stop()  # every record, offset and group is gone with it
        broker = LocalBroker(port, log_path=tmp_path / "broker-2.log").start()
        back = time.monotonic()
        # What the learner applied before it saw the log gone is in its checkpoint and metrics.jsonl by then.
        while not went_on("learner"):
            assert time.monotonic() < back + 300 and first.poll() is None, (tmp_path / "up-1.log").read_text()[-3000:]
            time.sleep(0.1)
        before = lines()
        while lines() <= before:
            assert time.monotonic() < back + 300 and first.poll() is None, (tmp_path / "up-1.log").read_text()[-3000:]
            time.sleep(0.1)
        print(f"\nfirst update {time.monotonic() - back:.1f} s after the new broker started, nobody acting")
        time.sleep(5)  # the services work on the new broker a while
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=180)
        checkpointed = lines()
        assert checkpointed < steps
        settled = load_latest_checkpoint(tmp_path / "run" / "checkpoints")[1]["ledger"]["below"]
        second = up("up-2.log", "--resume")
        assert second.wait(timeout=600) == 0, (tmp_path / "up-2.log").read_text()[-3000:]
    finally:
        for process in (first, locals().get("second")):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        broker.stop()
    automatic = (tmp_path / "up-1.log").read_text()
    assert all(went_on(role) for role in roles), "every service went on on the new log in its process"
    assert "again in resume mode" not in automatic, "no process was started again"
    published = re.findall(r"feeder-0: publishing prompt batches (\d+)\.\.", automatic)
    assert len(published) == 2 and int(published[1]) > 0, (
        f"published again from the learner's settled batch: {published}"
    )
    records = [json.loads(line) for line in metrics.open()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "every version applied exactly once"
    assert_each_group_once(records, run_id, prompt_batches)
    resumed = (tmp_path / "up-2.log").read_text()
    assert f"publishing prompt batches {settled}..{prompt_batches - 1}" in resumed, "the feeder skipped settled ones"


@pytest.mark.slow
@pytest.mark.soak
def test_runs_on_one_broker_share_nothing_at_once_or_one_after_another(own_broker, tmp_path, model_cache):
    """Two runs at the same time on one broker, then a third after them: each in its own namespace (its run id), so
    no run consumes another's input, and each applies every version once."""
    steps = 3

    def run(name):
        folder = tmp_path / name
        folder.mkdir()
        run_id = unique(name)
        return (
            run_id,
            folder,
            *start_up(own_broker, folder, model_cache, steps, run_id, overrides=("data.eval_prompts=0",)),
        )

    def finished(run_id, folder, up, output, metrics):
        assert up.wait(timeout=600) == 0, output.read_text()[-3000:]
        records = [json.loads(line) for line in metrics.open()]
        assert [r["step"] for r in records] == list(range(1, steps + 1)), "every version applied exactly once"
        assert_each_group_once(records, run_id, steps)
        assert not re.search(r"skipping \w+ \S+ of run", output.read_text()), "no record of another run came here"

    together = [run("first"), run("second")]
    try:
        for started in together:
            finished(*started)
        finished(*run("after"))
    finally:
        for _, _, up, _, _ in together:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.soak
def test_chaos_random_kill_9_across_all_roles_applies_every_version_once(own_broker, tmp_path, model_cache):
    """`streamppo up` with two scorers and a streaming generator (records of 4 groups, updates of 8: half a prompt
    batch); ten `kill -9`s of random services while it runs; `up` restarts each. Every batch over 2 kB (nearly all)
    travels by reference, so its file must outlive every re-delivery. A learner killed after updates it had not
    checkpointed comes back at an older version while groups sampled by the rolled-back ones are on their way: they
    are trained (off-policy), and the generator takes the new lineage's weights (this stalled before)."""
    import random

    steps, run_id, kills = 40, unique("chaos"), 10
    prompt_batches = steps * 8 // 16  # updates × groups per update, in batches of 16 prompts
    up, output, metrics = start_up(
        own_broker,
        tmp_path,
        model_cache,
        steps,
        run_id,
        ("--replicas", "scorer=2"),
        (
            "pipeline.max_staleness=1",
            "learner.checkpoint_every=2",
            "pipeline.inline_max_bytes=2000",
            "kafka.retention.remove_committed_batches=true",  # files go at commit: kills must not strand them
            "generation.streaming=true",
            "generation.groups_per_record=4",
            "learner.groups_per_update=8",
        ),
    )
    # Every role dies at least once (the learner three times, a scorer twice), in a seeded order, at seeded moments.
    # A learner rolled back by a kill drops the groups that waited too long meanwhile; they are replaced, and the run
    # makes every update (it once ended at 39 of 40).
    chance, killed = random.Random(7), []
    roles = ["generator-0", "scorer-0", "scorer-1", "advantage-0", "learner-0"]
    extra = ["learner-0", "learner-0", "scorer-1"]
    victims = roles + extra + [chance.choice(roles) for _ in range(kills - len(roles) - len(extra))]
    chance.shuffle(victims)
    try:
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().strip()):  # the kills fall while it trains
            assert time.monotonic() < deadline and up.poll() is None, output.read_text()[-3000:]
            time.sleep(0.2)
        while len(killed) < kills and up.poll() is None and time.monotonic() < deadline:
            time.sleep(chance.uniform(1.5, 4.0))
            victim = victims[len(killed)]
            pattern = f"replica-id {victim} .*run.run_id={run_id}"
            if subprocess.run(["pkill", "-9", "-f", pattern]).returncode == 0:
                killed.append(victim)
        assert len(killed) == kills, f"only {killed} killed before the run ended; make it longer"
        try:
            assert up.wait(timeout=900) == 0, output.read_text()[-3000:]
        except subprocess.TimeoutExpired:  # a stall: what each replica holds and waits for says where
            status = subprocess.run(
                [sys.executable, "-m", "services.cli", "status", "--run-dir", str(tmp_path / "run")],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
            )
            pytest.fail(f"the run stalled after {killed}; streamppo status:\n{status.stdout}{status.stderr}")
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    text = output.read_text()
    assert text.count("with code -9; restarting it") == kills
    for victim in set(killed):  # `up` restarts whichever service died, after a pause it names
        assert re.search(rf"{victim} exited with code -9; restarting it in [0-9.]+ s", text), victim
    records = [json.loads(line) for line in metrics.open()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "every version applied exactly once"
    assert [r["policy_version"] for r in records] == [float(v) for v in range(1, steps + 1)], "no update lost"
    assert_each_group_once(records, run_id, prompt_batches)
    assert all(r["staleness_max"] <= 1 for r in records), "no group trained past max_staleness"
    # With remove_committed_batches a file goes once its record is committed past; a kill may orphan one (written,
    # never sent or removed).
    store = tmp_path / "run" / "batches"
    assert store.is_dir(), "batches went by reference (the store is made by the first one)"
    left = list(store.iterdir())
    assert len(left) <= 2 * kills, f"{len(left)} batch files left of ~{12 * steps}"


def learner_ranks(run_id: str) -> dict[int, int]:
    """rank → pid of the learner's rank processes of ``run_id`` (not their launcher)."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            command = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in command]
        if "services.cli" in words and "learner" in words and f"run.run_id={run_id}" in words:
            if "torch.distributed.run" in words:
                continue
            variables = dict(v.decode(errors="replace").partition("=")[::2] for v in environ if b"=" in v)
            if "RANK" in variables:
                ranks[int(variables["RANK"])] = int(entry)
    return ranks


@pytest.mark.slow
@pytest.mark.soak
def test_a_two_rank_learner_survives_kill_9_of_a_rank_and_applies_every_version_once(
    own_broker, make_config, tmp_path, model_cache
):
    """`streamppo up` with an FSDP learner of two ranks and two generator replicas that take the actor by broadcast;
    one rank is killed mid-run, then the other: `streamppo learner` restarts both from the sharded checkpoint each
    time, the generators join each new learner's broadcast group, and the run ends with each update once, reward
    up, and prompt batches shared by both generators."""
    kafka_broker = own_broker
    steps, run_id = 10, unique("ranks")
    up, output, metrics = start_up(
        kafka_broker,
        tmp_path,
        model_cache,
        steps,
        run_id,
        ("--replicas", "generator=2"),
        (
            "learner.parallel.strategy=fsdp",
            "learner.parallel.processes=2",
            "learner.checkpoint_every=2",
            f"weights.broadcast.address=127.0.0.1:{free_port()}",
            "weights.broadcast.receivers=2",
            "weights.broadcast.timeout_s=10",
        ),
        verbose=True,
    )
    killed = []
    try:
        deadline = time.monotonic() + 600
        for rank, after_updates in ((1, 3), (0, 6)):
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after_updates):
                assert time.monotonic() < deadline and up.poll() is None, output.read_text()[-3000:]
                time.sleep(0.2)
            pids = learner_ranks(run_id)
            assert sorted(pids) == [0, 1], f"two ranks run: {pids}"
            os.kill(pids[rank], signal.SIGKILL)
            killed.append(rank)
        assert up.wait(timeout=600) == 0, output.read_text()[-3000:]
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    text = output.read_text()
    # Each death in a line, and the ranks that saw it go in a line each: no tracebacks, no launcher report.
    assert "learner rank 1 ended: killed by SIGKILL" in text and "learner rank 0 ended: killed by SIGKILL" in text
    learner = [line for line in text.splitlines() if line.lstrip().startswith("learner-0 |")]
    assert not [line for line in learner if "Traceback" in line or "ChildFailedError" in line], "\n".join(learner)
    for generator in ("generator-0", "generator-1"):
        by_broadcast = re.findall(rf"{generator}: actor weights v(\d+) loaded from the broadcast", text)
        # From every learner the generators joined: before the first kill, between the kills, after the second.
        assert len(by_broadcast) >= 3, (generator, by_broadcast)
    records = [json.loads(line) for line in metrics.open()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), "every version applied exactly once"
    assert_each_group_once(records, run_id, steps)
    rewards = [r["reward_mean"] for r in records]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.1, rewards
    rollouts = run_messages(make_config(*kafka_broker), "rollouts", run_id, steps)
    producers = {k: m.producer for k, m in rollouts.items()}
    assert set(producers.values()) == {"generator-0", "generator-1"}, "both generator replicas sampled"
