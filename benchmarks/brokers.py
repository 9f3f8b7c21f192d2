"""Apache Kafka against the memory broker, side by side in one run, on this machine.

1. One hop (produce, flush, consume) of a 0.5B-shaped experience batch: inline (the record carries the batch) and by
   reference (the record carries a ``BatchReference``; the batch goes to the run's batch store and is read back and
   checked, as the services do past ``pipeline.inline_max_bytes``). Latency p50/p99 of single hops, and records/s
   of a burst.
2. The vowels example under ``streamppo up`` on each broker (``--broker kafka|memory``): wall time and the ``done:``
   line.

Run: ``python -m benchmarks.brokers [--hops N] [--no-up]`` (prints JSON; the numbers go to benchmarks/RESULTS.md by
hand, section 17). Measures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from common.batch_store import BatchStore
from common.schema import ExperienceBatch, decode, encode, new_header
from services.transport import TopicSpec
from services.transport.brokers.apache_kafka import KAFKA_VERSION, KafkaBroker
from services.transport.brokers.local_broker import LocalBroker
from services.transport.kafka import KafkaBus, KafkaSettings

REPO = Path(__file__).resolve().parent.parent
# A 0.5B model's update batch as the learner takes it (verl's quickstart shape, scaled to one record): 64 responses of
# up to 512 tokens after prompts of up to 256.
N, T, P = 64, 512, 256


def experience_batch() -> ExperienceBatch:
    rng = np.random.default_rng(0)
    floats = lambda: rng.standard_normal((N, T)).astype(np.float32)  # noqa: E731
    return ExperienceBatch(
        **new_header("bench-00000000", "bench", 0, {"run.id": "bench"}),
        step=0,
        group_index=np.repeat(np.arange(N // 8), 8),
        prompt_text=["p" * 200] * N,
        prompt_label=[""] * N,
        response_text=["r" * 400] * N,
        prompt_tokens=rng.integers(0, 50_000, (N, P)),
        prompt_lengths=np.full(N, P),
        response_tokens=rng.integers(0, 50_000, (N, T)),
        response_lengths=np.full(N, T),
        finished=np.ones(N, bool),
        behaviour_logprobs=floats(),
        token_versions=np.zeros((N, T), np.int32),
        response_mask=np.ones((N, T), bool),
        turns=np.ones(N, np.int64),
        environment_reward=np.zeros(N, np.float32),
        dead_lettered_groups=np.zeros(0, np.int64),
        scores=rng.standard_normal(N).astype(np.float32),
        ref_logprobs=floats(),
        values=floats(),
        kl=floats(),
        token_rewards=floats(),
        advantages=floats(),
        returns=floats(),
        no_signal_groups=np.zeros(0, np.int64),
    )


def _hops(bus: KafkaBus, payload: bytes, hops: int, store: BatchStore | None, message) -> dict:
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    bus.create_topics([TopicSpec(topic, 1)])
    producer, consumer = bus.producer("bench"), bus.consumer(topic, None, "bench")
    producer.send(topic, b"warm-up")
    producer.flush()
    while not consumer.poll(0.05, 1):
        pass

    def send():
        value = payload if store is None else encode(store.put(message, payload))
        producer.send(topic, value)
        producer.flush()

    def received(records) -> None:
        for record in records:
            if store is not None:  # read back and checked, as a service reads a batch by reference
                decode(BatchStore.get(decode(record.value)))

    latencies = []
    for _ in range(hops):
        started = time.perf_counter()
        send()
        while not (records := consumer.poll(0.01, 1)):
            pass
        received(records)
        latencies.append(time.perf_counter() - started)
    started, got = time.perf_counter(), 0
    for _ in range(hops):
        value = payload if store is None else encode(store.put(message, payload))
        producer.send(topic, value)
    producer.flush()
    while got < hops:
        records = consumer.poll(0.05, 100)
        received(records)
        got += len(records)
    seconds = time.perf_counter() - started
    consumer.close()
    producer.close()
    ms = sorted(1000 * x for x in latencies)
    return {
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
        "records_per_s": round(hops / seconds, 1),
        "mb_per_s": round(hops * len(payload) / seconds / 1e6, 1),
    }


def bench_hops(hops: int) -> dict:
    message = experience_batch()
    payload = encode(message)
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        store = BatchStore(Path(folder) / "batches")
        brokers = {
            f"Apache Kafka {KAFKA_VERSION}": lambda: KafkaBroker(Path(folder) / "kafka"),
            "memory broker (tansu)": LocalBroker,
        }
        for name, make in brokers.items():
            broker = make().start()
            try:
                idempotent = isinstance(broker, KafkaBroker)
                bus = KafkaBus(KafkaSettings(bootstrap=broker.bootstrap, idempotent_producer=idempotent))
                rows[name] = {
                    "inline": _hops(bus, payload, hops, None, message),
                    "by_reference": _hops(bus, payload, hops, store, message),
                }
                bus.close()
            finally:
                broker.stop()
    return {"batch": f"ExperienceBatch {N}x{T} (+{P} prompt tokens)", "bytes": len(payload), "hops": hops, **rows}


def bench_up(steps: int = 60) -> dict:
    rows = {}
    for broker in ("kafka", "memory"):
        with tempfile.TemporaryDirectory() as folder:
            command = [sys.executable, "-m", "services.cli", "up", "--broker", broker, "--config",
                       str(REPO / "examples/vowels/config.yaml"), "--set", f"run.dir={folder}/run",
                       "--set", f"run.steps={steps}"]  # fmt: skip
            started = time.perf_counter()
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
            seconds = time.perf_counter() - started
            summary = [line for line in done.stdout.splitlines() if line.startswith("done:")]
            first = done.stdout.splitlines()[0] if done.stdout else ""
            rows[broker] = {"seconds": round(seconds, 1), "rc": done.returncode, "done": summary[-1:], "first": first}
    rows["kafka_vs_memory"] = round(rows["kafka"]["seconds"] / rows["memory"]["seconds"], 2)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hops", type=int, default=40)
    parser.add_argument("--no-up", action="store_true")
    args = parser.parse_args(argv)
    result = {"hops": bench_hops(args.hops)}
    if not args.no_up:
        result["up"] = bench_up()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
