"""The simulated cluster, measured: the real services over the real (local) broker, model calls simulated.

Every run starts a fresh local broker and each replica as its own process (``benchmarks/cluster/simulated.py``),
with the seconds of a cost profile (``profiles.py``) × ``SCALE``, so that stage times of tens of seconds take about
a second and the section fits in minutes. What is not scaled (encoding, Kafka hops, commits, holds, rebalances)
therefore weighs ``1 / SCALE`` times more here than on the accelerators priced: the efficiencies are lower bounds.

Measured:

1. pipeline efficiency, updates/s over the ideal, for ``max_staleness`` 0..3, balanced and generation-heavy;
2. throughput of 1/2/4/8 scorers and 1/2/4 generators against linear, each stage on its own;
3. long-tailed response lengths at ``max_staleness`` 0/1/2 (with 1 and 2 generators): speed-up over synchronous;
4. one hop's overhead (encode, produce, fetch, decode, commit) against batch size up to the 7B batch.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.cluster.profiles import PROFILES, CostModel, CostProfile, derivation

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "vowels" / "config.yaml"
SCALE = 0.05  # simulated seconds per second of the profile
STAGE_SCALE = 0.1  # in the replica measurements
STAGE_RUN = "stage"  # their run id: inputs are made once for all of them
PARTITIONS = 8  # of the data topics: as many as the most replicas of a role measured


def _overrides(profile: CostProfile, run_dir: Path, steps: int, staleness: int, run_id: str = "") -> list[str]:
    return [
        f"run.dir={run_dir}",
        f"run.run_id={run_id or f'sim{uuid.uuid4().hex[:8]}'}",
        f"run.steps={steps}",
        f"data.batch_size={profile.prompts}",
        f"generation.n={profile.n}",
        f"generation.max_new_tokens={profile.max_response_tokens}",
        f"pipeline.max_staleness={staleness}",
        f"kafka.partitions={PARTITIONS}",
        "kafka.idempotent_producer=false",  # the local broker's limits, as `streamppo up` sets them
        "kafka.session_timeout_ms=1000",
        "kafka.heartbeat_interval_ms=250",
        "learner.mini_batch_size=4",  # the tiny learner trains on a slice (simulated.TRAINED_ROWS)
        "learner.ppo_epochs=1",
        "generation.backend=transformers",  # the sampler the stand-in replaces: no engine to start
    ]


class Cluster:
    """Simulated replicas as processes on one fresh local broker; logs in ``folder``."""

    def __init__(self, profile: str, overrides: list[str], folder: Path, scale: float = SCALE):
        from services.transport.brokers.local_broker import LocalBroker

        self.profile, self.overrides, self.folder, self.scale = profile, overrides, folder, scale
        self.broker = LocalBroker().start()
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, role: str, replicas: int = 1, assignment: str = "roundrobin") -> None:
        for i in range(replicas):
            name = f"{role}-{i}"
            command = [
                sys.executable,
                "-m",
                "benchmarks.cluster.simulated",
                role,
                f"--profile={self.profile}",
                f"--scale={self.scale}",
                f"--config={EXAMPLE}",
                f"--bootstrap={self.broker.bootstrap}",
                f"--replica-id={name}",
                f"--assignment={assignment}",
                *[f"--set={o}" for o in self.overrides],
            ]
            log = (self.folder / f"{name}.log").open("w")
            # One thread each: a stand-in waits, it does not compute; what is left is this machine's glue work.
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            self.processes[name] = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait(self, name: str, timeout_s: float) -> None:
        try:
            code = self.processes[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{name} did not finish in {timeout_s:.0f} s; see {self.folder / name}.log") from None
        if code != 0:
            raise RuntimeError(f"{name} exited with {code}: {(self.folder / f'{name}.log').read_text()[-3000:]}")

    def breakdowns(self) -> list[dict]:
        """Each replica's time breakdown, as it logs it on exit."""
        found = []
        for log in sorted(self.folder.glob("*.log")):
            for line in log.read_text().splitlines():
                if "time breakdown" in line:
                    found.append(json.loads(line.split("time breakdown ", 1)[1]))
        return found

    def close(self) -> None:
        from services.launch.cluster import stop_all

        stop_all(list(self.processes.values()))
        self.broker.stop()


def dependency_bound(stages: dict[str, float], staleness: int, generators: int = 1) -> float:
    """Updates/s no implementation can beat: the slowest stage (generation shared by ``generators``), and the
    loop the staleness bound closes. Step ``s`` may be sampled only with the weights of update ``s − k``, which
    trains on step ``s − k − 1``: so the ``k + 1`` steps from ``s − k`` to ``s`` pass through every stage, one
    after the other, within one round of the loop."""
    return min(1 / slowest_stage(stages, generators), (staleness + 1) / sum(stages.values()))


def slowest_stage(stages: dict[str, float], generators: int = 1) -> float:
    """Seconds per step of the slowest stage, generation shared by ``generators``."""
    return max(stages["generator"] / generators, *(v for k, v in stages.items() if k != "generator"))


def run_pipeline(
    profile_name: str,
    staleness: int,
    steps: int,
    generators: int = 1,
    assignment: str = "roundrobin",
    streaming: bool = False,
    groups_per_record: int | None = None,
) -> dict:
    """One run of every role; updates/s from the learner's first update to its last, against the bounds.
    ``assignment``: how the generators' group deals partitions (``range``: as it did before); ``streaming``: the
    generator streams (continuous batching, groups sent on as they finish, ``groups_per_record`` to a record,
    ``STREAM_GROUPS`` by default)."""
    groups_per_record = (groups_per_record or STREAM_GROUPS) if streaming else None
    profile = PROFILES[profile_name]
    stages = {role: s * SCALE for role, s in profile.stage_seconds().items()}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        overrides = _overrides(profile, folder / "run", steps, staleness)
        if streaming:
            overrides += ["generation.streaming=true", f"generation.groups_per_record={groups_per_record}"]
        cluster = Cluster(profile_name, overrides, folder)
        try:
            cluster.start("learner")
            cluster.start("advantage")
            cluster.start("scorer")
            cluster.start("generator", generators, assignment)
            cluster.start("feeder")
            cluster.wait("learner-0", timeout_s=300 + steps * sum(stages.values()) * 3)
        finally:
            cluster.close()
        records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").open()]
        breakdowns = cluster.breakdowns()
    times = [r["time"] for r in records]
    achieved = (len(times) - 1) / (times[-1] - times[0])
    issue_ideal = 1 / sum(stages.values()) if staleness == 0 else 1 / slowest_stage(stages, generators)
    bound = dependency_bound(stages, staleness, generators)
    return {
        "profile": profile_name,
        "max_staleness": staleness,
        "generators": generators,
        "assignment": assignment,
        "updates": len(records),
        "stage_s": stages,
        "updates_per_s": achieved,
        "ideal_per_s": issue_ideal,
        "bound_per_s": bound,
        "efficiency": achieved / issue_ideal,
        "efficiency_of_bound": achieved / bound,
        "staleness_seen": sorted({r["staleness_max"] for r in records}),
        "staleness_counts": _staleness_counts(records),
        "dropped_stale": records[-1]["dropped_stale"],
        "streaming": streaming,
        "groups_per_record": groups_per_record,
        "breakdowns": breakdowns,
    }


def _staleness_counts(records: list[dict]) -> dict[str, int]:
    """Groups trained at each staleness (versions behind the learner), over the run."""
    counts: dict[str, int] = {}
    for record in records:
        for versions, groups in record["staleness_counts"].items():
            counts[versions] = counts.get(versions, 0) + groups
    return dict(sorted(counts.items(), key=lambda item: int(item[0])))


STREAM_GROUPS = 8  # groups to a streamed record: 8 records per step of the 0.5B profiles


def bench_streaming(steps: int = 12) -> dict:
    """Long-tailed responses, one generator: batch mode (each generation waits for its batch's longest answer)
    against streaming (continuous batching, groups sent on as they finish, weights changing between tokens), at
    max_staleness 0, 1, 2; each against the bound 1 / slowest stage at mean throughput."""
    profile = PROFILES["0.5b-long-tail"]
    mean_stages = {role: s * SCALE for role, s in profile.stage_seconds(streaming=True).items()}
    runs = []
    # Last, streaming in records of half a prompt batch: what the per-record costs of the stages after the
    # generator (a forward pass per record) take from streaming's records of an eighth.
    settings = [(False, k, None) for k in (0, 1, 2)] + [(True, k, None) for k in (0, 1, 2)] + [(True, 2, 32)]
    for streaming, k, groups_per_record in settings:
        run = run_pipeline("0.5b-long-tail", k, steps, streaming=streaming, groups_per_record=groups_per_record)
        run["mean_bound_per_s"] = 1 / slowest_stage(mean_stages)
        run["of_mean_bound"] = run["updates_per_s"] / run["mean_bound_per_s"]
        runs.append(run)
    return {
        "setup": f"Simulated compute × {SCALE}, as in the cluster section; 0.5b-long-tail (log-normal response "
        f"lengths, σ 1, mean 512, up to 2,048); one generator; runs of {steps} updates. Batch mode: one record per "
        "prompt batch, generation priced by its longest response. Streaming: a continuous-batching engine of one "
        "batch's 256 sequences, each costing its own length, prompt batches admitted as its queue empties, groups "
        f"sent on as they finish ({STREAM_GROUPS} of one prompt batch to a record), weights loaded between decode "
        "steps (the engine pauses while they load). The bound: 1 / the slowest stage at mean throughput "
        "(generation paying the mean length, not the longest).",
        "stage_s": mean_stages,
        "runs": runs,
    }


def stage_throughput(
    role: str, replicas: int, profile_name: str, partitioning: str, inputs: list, per_replica: int = 4
) -> dict:
    """Batches/s of ``replicas`` replicas of one stage (generator or scorer) fed ``per_replica`` of ``inputs`` each,
    put on partitions as the runtime does (``"step"``: ``common.schema.message_partition``) or, as it did before, by
    the hash of their key (``"key"``). At ``STAGE_SCALE``: twice the pipeline's, so that a batch outweighs the
    start of a burst."""
    from common.batch_store import BatchStore
    from common.config import load_config
    from common.schema import decode, message_key, message_partition
    from services.roles import ROLES
    from services.runtime.run_bus import kafka_bus

    profile = PROFILES[profile_name]
    stage_s = profile.stage_seconds()[role] * STAGE_SCALE
    batches = per_replica * replicas
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        # No weight gate: every prompt batch may be sampled by the initial weights.
        overrides = _overrides(profile, folder / "run", batches, staleness=batches, run_id=STAGE_RUN)
        config = load_config(EXAMPLE, overrides)
        store = BatchStore(config.batch_store)
        cluster = Cluster(profile_name, overrides, folder, STAGE_SCALE)
        try:
            cluster.start(role, replicas)
            bus = kafka_bus(config, cluster.broker.bootstrap)
            out = bus.consumer(ROLES[role].output_topic, group=f"sink-{uuid.uuid4().hex[:6]}", client_id="sink")
            _await_replicas(bus, config.run.run_id, replicas, folder)
            producer = bus.producer("bench")
            started = time.perf_counter()
            for message in inputs[:batches]:
                payload, _ = store.record_value(message, config.pipeline.inline_max_bytes)  # as the runtime does
                partition = message_partition(message, PARTITIONS) if partitioning == "step" else None
                producer.send(ROLES[role].input_topic, payload, key=message_key(message), partition=partition)
            producer.flush()
            seen: set[str] = set()
            deadline = time.monotonic() + 60 + 3 * batches * stage_s
            while len(seen) < batches and time.monotonic() < deadline:
                seen |= {decode(r.value).batch_id for r in out.poll(0.2, 100)}  # batches, or references to them
            seconds = time.perf_counter() - started
            bus.close()
        finally:
            cluster.close()
    return {
        "role": role,
        "replicas": replicas,
        "partitioning": {"step": "step (now)", "key": "key hash (before)"}[partitioning],
        "batches": len(seen),
        "seconds": seconds,
        "batches_per_s": len(seen) / seconds,
        "linear_per_s": replicas / stage_s,
        "of_linear": len(seen) / seconds / (replicas / stage_s),
    }


def stage_inputs(role: str, profile_name: str, batches: int) -> list:
    """The input messages of ``role``: prompt batches of the profile's shape, or the rollouts of them."""
    from benchmarks.cluster.simulated import SimulatedFeeder, SimulatedGenerator
    from common.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        overrides = _overrides(PROFILES[profile_name], Path(tmp), batches, staleness=batches, run_id=STAGE_RUN)
        config = load_config(EXAMPLE, overrides)
    cost = CostModel(PROFILES[profile_name], scale=0.0, seed=0)
    feeder = SimulatedFeeder(config, "bench-feeder")
    feeder.simulate(cost)
    prompts = [feeder.batch(step) for step in range(batches)]
    if role == "generator":
        return prompts
    generator = SimulatedGenerator(config, "bench-generator")
    generator.simulate(cost)
    return [generator.process(batch)[0] for batch in prompts]


def _await_replicas(bus, run_id: str, replicas: int, folder: Path, timeout_s: float = 180) -> None:
    """Wait until every replica says it serves (on the status topic) and their group has settled."""
    from common.schema import decode
    from services.roles import STATUS_TOPIC

    status = bus.consumer(STATUS_TOPIC, group=None, client_id="bench-status")
    serving: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(serving) < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(serving)} of {replicas} replicas started in {timeout_s} s; logs in {folder}")
        serving |= {m.replica for m in (decode(r.value) for r in status.poll(0.5, 100)) if m.run_id == run_id}
    status.close()
    time.sleep(3)  # the group's last rebalance (sessions of 1 s)


def per_hop(sizes: list[tuple[str, int, int, int, float]], folder: Path, repeat: int = 5) -> list[dict]:
    """One hop of an experience batch of each size, inline and by reference (median seconds of each part).

    Inline: encode, produce + flush, fetch, decode, commit. By reference: encode, write the file to the batch store
    in ``folder`` (with its digest) + produce the reference, fetch, read and check the file + decode, commit +
    remove the file. ``sizes``: (label, sequences, prompt tokens, response tokens, the profile's step seconds).
    """
    from benchmarks.batches import experience_batch
    from common.batch_store import BatchStore
    from common.schema import decode, encode
    from services.transport import TopicSpec
    from services.transport.brokers.local_broker import LocalBroker
    from services.transport.kafka import KafkaBus, KafkaSettings

    store = BatchStore(folder / "batches")
    rows = []
    with LocalBroker() as broker:
        # Records up to 256 MB for the measurement: the runtime's default limit (64 MB) refuses the 7B batch.
        bus = KafkaBus(KafkaSettings(broker.bootstrap, max_message_bytes=256 << 20, idempotent_producer=False))
        for label, n, p, t, step_s in sizes:
            message = experience_batch(n=n, t=t, p=p)
            for path in ("inline", "by reference"):
                topic = f"hop-{uuid.uuid4().hex[:6]}"
                bus.create_topics([TopicSpec(topic, 1)])
                producer, consumer = bus.producer("hop"), bus.consumer(topic, group="hop", client_id="hop")
                parts: dict[str, list[float]] = {k: [] for k in ("encode", "produce", "fetch", "decode", "commit")}
                for _ in range(repeat + 1):
                    clock = time.perf_counter()

                    def part(name: str) -> None:
                        nonlocal clock
                        parts[name].append(time.perf_counter() - clock)
                        clock = time.perf_counter()

                    payload = encode(message)
                    part("encode")
                    reference = store.put(message, payload) if path == "by reference" else None
                    producer.send(topic, encode(reference) if reference else payload, key=b"k")
                    producer.flush()
                    part("produce")
                    records = []
                    while not records:
                        records = consumer.poll(5.0, 1)
                    part("fetch")
                    record = decode(records[0].value)
                    decode(store.get(record)) if path == "by reference" else None
                    part("decode")
                    consumer.commit(records[0])
                    if reference:
                        store.remove(reference)
                    part("commit")
                medians = {k: statistics.median(v[1:]) for k, v in parts.items()}  # the first is the warm-up
                hop = sum(medians.values())
                rows.append(
                    {"batch": label, "path": path, "mb": len(payload) / 1e6, **medians, "hop_s": hop}
                    | {"of_step": hop / step_s if step_s else None}
                )
                consumer.close()
                producer.close()
        bus.close()
    return rows


def bench_cluster() -> dict:
    """The whole section (``python -m benchmarks.run --only cluster``)."""
    from benchmarks.cluster.profiles import SOURCES

    steps = 8
    pipeline = [run_pipeline("0.5b-balanced", k, steps) for k in (0, 1, 2, 3)]
    pipeline += [run_pipeline("0.5b-generation-heavy", k, steps) for k in (0, 1, 2)]
    replicas = []
    for role, counts in (("scorer", (1, 2, 4, 8)), ("generator", (1, 2, 4))):
        inputs = stage_inputs(role, "0.5b-balanced", 4 * max(counts))
        for count in counts:
            replicas.append(stage_throughput(role, count, "0.5b-balanced", "step", inputs))
        # Before, side by side: inputs partitioned by the hash of their batch id.
        replicas.append(stage_throughput(role, max(counts), "0.5b-balanced", "key", inputs))
    long_tail = [run_pipeline("0.5b-long-tail", k, steps, g) for k, g in ((0, 1), (1, 1), (2, 2))]
    long_tail.append(run_pipeline("0.5b-long-tail", 2, steps, 2, assignment="range"))  # before, side by side
    balanced, big = PROFILES["0.5b-balanced"], PROFILES["7b-8xh200"]
    sizes = [
        ("16 × (64 + 64)", 16, 64, 64, None),
        ("64 × (128 + 256)", 64, 128, 256, None),
        ("0.5B: 64 × 4, 512 + 512", 256, 512, 512, max(balanced.stage_seconds().values())),
        ("7B: 128 × 8, 1,024 + 2,048", 1024, 1024, 2048, max(big.stage_seconds().values())),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        hops = per_hop(sizes, Path(tmp))
    return {
        "setup": f"Simulated compute × {SCALE}; one process per replica; a fresh local broker per run; {PARTITIONS} "
        f"partitions per data topic; pipeline runs of {steps} steps, updates/s from the first update to the last.",
        "profiles": {name: {**p.__dict__, "stage_s": p.stage_seconds()} for name, p in PROFILES.items()},
        "derivation": derivation(),
        "sources": SOURCES,
        "scale": SCALE,
        "pipeline": pipeline,
        "replicas_setup": f"One stage on its own, 0.5b-balanced × {STAGE_SCALE} (1.7 s a batch): its replicas "
        "started, then 4 inputs per replica put on its topic at once; batches/s until the last output, against "
        "replicas ÷ stage seconds. "
        "Inputs go to partitions by step, as the runtime now sends them, or (before) by the hash of the batch id.",
        "replicas": replicas,
        "long_tail_setup": "0.5b-long-tail: each generation waits for its batch's longest response (log-normal "
        "lengths, σ 1, mean 512, up to 2,048: about 4× the balanced profile's generation); the other stages "
        "price tokens. Speed-up over max_staleness 0 with one generator.",
        "long_tail": long_tail,
        "per_hop_setup": "One experience batch through one hop over the local broker, median of 5 (seconds); "
        "by reference: the file written (fsynced) to a batch store on this machine's disk and read back, with its "
        "digest. 'of a step': the hop over the profile's pipelined step (its slowest stage, unscaled).",
        "per_hop": hops,
    }


if __name__ == "__main__":
    print(json.dumps(bench_cluster(), indent=2, default=str))
