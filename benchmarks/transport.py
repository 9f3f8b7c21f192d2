"""Transport costs on this machine, over the local Kafka-protocol broker.

1. End-to-end latency of one batch through prompts → rollouts → scored → experience → weights with no-op services
   (each stage decodes, derives its output message with zero-filled fields, encodes and produces; no model).
2. Rebalance time: how long after ``kill -9`` of one member of a consumer group the survivor receives a record
   from a partition the dead member held.

Run: ``python benchmarks/transport.py`` (prints JSON). Measures; asserts nothing.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import load_config  # noqa: E402
from common.schema import (  # noqa: E402
    ExperienceBatch,
    PromptBatch,
    RolloutBatch,
    ScoredBatch,
    WeightAnnouncement,
    derive,
    encode,
    new_header,
)
from services.roles import pipeline_topics  # noqa: E402
from services.runtime import Replica  # noqa: E402
from services.service import Service  # noqa: E402
from services.transport import TopicSpec  # noqa: E402
from services.transport.brokers.local_broker import LocalBroker  # noqa: E402
from services.transport.kafka import KafkaBus, KafkaSettings  # noqa: E402

N, T, P = 64, 128, 32


class NoOp(Service):
    """The role's topics and delivery rules, with ``make`` in place of its model."""

    def __init__(self, role, make):
        self.role = role  # before Service.__init__, which looks the role up
        config = load_config(
            Path(__file__).resolve().parent.parent / "examples/vowels/config.yaml", ["run.run_id=bench"]
        )
        super().__init__(config, f"bench-{role}")
        self.make = make

    def process(self, message):
        return [self.make(message)]


def rollouts(m: PromptBatch) -> RolloutBatch:
    zeros = np.zeros((N, T), np.float32)
    return RolloutBatch(
        **new_header(m.batch_id, "g", 0, m.lineage),
        step=m.step,
        group_index=np.zeros(N, np.int64),
        prompt_text=["p"] * N,
        prompt_label=[""] * N,
        response_text=["r"] * N,
        prompt_tokens=np.zeros((N, P), np.int64),
        prompt_lengths=np.full(N, P),
        response_tokens=np.zeros((N, T), np.int64),
        response_lengths=np.full(N, T),
        finished=np.ones(N, bool),
        behaviour_logprobs=zeros,
        token_versions=np.zeros((N, T), np.int32),
        response_mask=np.ones((N, T), bool),
        turns=np.ones(N, np.int64),
        environment_reward=np.zeros(N, np.float32),
        dead_lettered_groups=np.zeros(0, np.int64),
    )


def scored(m):
    return derive(m, ScoredBatch, "s", scores=np.zeros(N, np.float32), ref_logprobs=m.behaviour_logprobs)


def experience(m):
    z = m.ref_logprobs
    none = np.zeros(0, np.int64)
    return derive(
        m, ExperienceBatch, "a", values=z, kl=z, token_rewards=z, advantages=z, returns=z, no_signal_groups=none
    )


def weights(m):
    return WeightAnnouncement(
        **new_header(m.batch_id, "l", 1, m.lineage),
        model="actor",
        uri="/dev/null",
        digest="blake3:" + "0" * 64,
        chain=["blake3:" + "0" * 64 + " /dev/null"],
        num_bytes=0,
        broadcast_digest="",
    )


def pipeline_latency(
    bootstrap: str, batches: int = 30, fetch_max_wait_ms: int = KafkaSettings("").fetch_max_wait_ms
) -> dict:
    settings = KafkaSettings(bootstrap=bootstrap, idempotent_producer=False, fetch_max_wait_ms=fetch_max_wait_ms)
    bus = KafkaBus(settings)
    bus.create_topics(pipeline_topics(4))
    stages = [("generator", rollouts), ("scorer", scored), ("advantage", experience), ("learner", weights)]
    stop = threading.Event()
    runners = [Replica(NoOp(*stage), lambda: bus).start().runner for stage in stages]

    def loop(runner):
        while not stop.is_set():
            runner.poll_once(0.05)

    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in runners]
    for thread in threads:
        thread.start()
    sink = bus.consumer("weights", None, "bench-sink")  # what is there before the first batch is read in warm-up
    producer = bus.producer("bench-feed")
    warm_up = time.monotonic() + 8  # let every group form, the sink's included (it joins on its first poll)
    while time.monotonic() < warm_up:
        sink.poll(0.2, 100)
    latencies = []
    for step in range(batches):
        batch = PromptBatch(
            **new_header(f"bench-{uuid.uuid4().hex}", "f", 0, {"run.id": "bench"}),
            step=step,
            prompt_index=np.zeros(1, np.int64),
            prompt_text=["x"],
            prompt_label=[""],
            prompt_tokens=np.zeros((1, P), np.int64),
            prompt_lengths=np.full(1, P),
        )
        started = time.perf_counter()
        producer.send("prompts", encode(batch), key=batch.batch_id.encode())
        producer.flush()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(r.key == b"actor" for r in sink.poll(0.01, 100)):
                latencies.append(time.perf_counter() - started)
                break
    stop.set()
    size = len(encode(experience(scored(rollouts(batch)))))
    return {
        "batches": len(latencies),
        "experience_bytes": size,
        "median_ms": 1000 * statistics.median(latencies),
        "p90_ms": 1000 * sorted(latencies)[int(0.9 * len(latencies))],
    }


CHILD = """
import sys, time
from services.transport.kafka import KafkaBus, KafkaSettings
bus = KafkaBus(KafkaSettings(bootstrap=sys.argv[1], idempotent_producer=False, session_timeout_ms=int(sys.argv[4]),
                             heartbeat_interval_ms=int(sys.argv[5])))
consumer = bus.consumer(sys.argv[2], sys.argv[3], "victim")
while True:
    for record in consumer.poll(0.2, 10):
        print(record.partition, flush=True)
"""


def rebalance_time(bootstrap: str, session_timeout_ms: int = 6000, heartbeat_interval_ms: int = 1000) -> dict:
    settings = KafkaSettings(
        bootstrap=bootstrap,
        idempotent_producer=False,
        session_timeout_ms=session_timeout_ms,
        heartbeat_interval_ms=heartbeat_interval_ms,
    )
    bus = KafkaBus(settings)
    topic, group = f"rebalance-{uuid.uuid4().hex[:6]}", f"g-{uuid.uuid4().hex[:6]}"
    bus.create_topics([TopicSpec(topic, 4)])
    survivor = bus.consumer(topic, group, "survivor")
    victim = subprocess.Popen(
        [sys.executable, "-c", CHILD, bootstrap, topic, group, str(session_timeout_ms), str(heartbeat_interval_ms)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "PYTHONPATH": "."},
    )
    producer = bus.producer("bench")
    own, deadline = set(), time.monotonic() + 60
    while time.monotonic() < deadline and len(own) < 2:  # wait until both members hold partitions
        for _ in range(4):
            producer.send(topic, b"x", key=None)
        producer.flush()
        own |= {r.partition for r in survivor.poll(0.5, 100)}
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed = time.perf_counter()
    while True:
        producer.send(topic, b"y")
        producer.flush()
        got = {r.partition for r in survivor.poll(0.1, 100) if r.value == b"y"}
        if got - own:
            return {
                "partitions_before": sorted(own),
                "seconds_to_take_over": time.perf_counter() - killed,
                "session_timeout_ms": session_timeout_ms,
                "heartbeat_interval_ms": heartbeat_interval_ms,
            }


if __name__ == "__main__":
    with LocalBroker() as broker:
        print(
            json.dumps(
                {
                    "pipeline_no_op": pipeline_latency(broker.bootstrap),
                    "pipeline_no_op_fetch_wait_500ms": pipeline_latency(broker.bootstrap, fetch_max_wait_ms=500),
                    "pipeline_no_op_fetch_wait_50ms": pipeline_latency(broker.bootstrap, fetch_max_wait_ms=50),
                    "rebalance_after_kill_9": rebalance_time(broker.bootstrap),
                },
                indent=2,
            )
        )
