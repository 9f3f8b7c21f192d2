"""A fleet's generator, measured on vLLM (for CPUs here): what a run's adapter update costs, and tokens/s of N LoRA
runs on one shared engine against N engines of their own on the same cores.

    python benchmarks/fleet.py adapters [--runs 4] [--updates 5]   # per adapter per update: publish, load, first use
    python benchmarks/fleet.py throughput [--runs 1 2 4] [--groups 16]  # one engine for N runs vs N engines

Each prints one JSON line per measurement (the numbers go to benchmarks/RESULTS.md by hand, section 16). The model is
SmolLM2-135M (the recipes' actor) with rank-16 adapters on q/k/v/o, as a run with ``model.lora`` would train it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "streamppo"
MODEL = "builtin:smollm2-135m-instruct"
PROMPT = "Question: what is 17 + 25? Answer:"


def _lora():
    from common.config import LoraOptions

    return LoraOptions(rank=16, alpha=32.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def _sampler(model_dir: Path, tokenizer, name: str, max_loras: int):
    from common.config import VllmOptions
    from services.generator.vllm_sampler import VllmSampler

    return VllmSampler(
        model_dir,
        "float32",
        False,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        VllmOptions(kv_cache_gib=0.5, max_loras=max_loras),
        lora=_lora(),
        name=name,
    )


def _learner(model_dir: Path, seed: int):
    import torch

    from common.models import add_lora, load_actor
    from common.weights import published_tensors

    learner = add_lora(load_actor(model_dir), _lora())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in published_tensors(learner).values():
            tensor.copy_(0.02 * torch.randn(tensor.shape, generator=generator))
    return learner


def _model():
    from common.models import load_tokenizer, resolve_model

    model_dir = resolve_model(MODEL, CACHE)
    return model_dir, load_tokenizer(model_dir)


def _sample(sampler, tokenizer, groups: int, seed: int) -> int:
    """``groups`` groups of 4 responses of up to 32 tokens; the tokens sampled."""
    from common.sampling import SamplingParams

    prompt = tokenizer(PROMPT)["input_ids"]
    for g in range(groups):
        sampler.submit(f"{seed}/{g}", prompt, SamplingParams(n=4, max_new_tokens=32, temperature=1.0, seed=seed + g))
    tokens = 0
    while sampler.in_flight():
        tokens += sum(int(samples.response_lengths.sum()) for _, samples in sampler.step(1.0))
    return tokens


def adapters(runs: int, updates: int) -> None:
    """Per adapter per update on one engine serving ``runs`` runs with one slot: the learner's publish (the adapters'
    snapshot into the store), the generator's load (verify, write the adapter folder), and the first group after it
    (vLLM loads the adapter from its folder) against a group whose adapter is loaded."""
    from common.weights import WeightStore

    model_dir, tokenizer = _model()
    store = WeightStore(Path(tempfile.mkdtemp(prefix="fleet-bench-")))
    samplers = [_sampler(model_dir, tokenizer, f"run-{i}", max_loras=1) for i in range(runs)]
    learners = [_learner(model_dir, i) for i in range(runs)]
    publish, load, first, warm = [], [], [], []
    try:
        for version in range(1, updates + 1):
            for i, (sampler, learner) in enumerate(zip(samplers, learners)):
                started = time.perf_counter()
                snapshot = store.save(f"actor-{i}", version, learner)
                publish.append(time.perf_counter() - started)
                started = time.perf_counter()
                sampler.load_snapshot(snapshot.chain, version)
                load.append(time.perf_counter() - started)
                started = time.perf_counter()
                _sample(sampler, tokenizer, 1, version * 100 + i)  # the adapter comes into the engine's one slot
                first.append(time.perf_counter() - started)
                started = time.perf_counter()
                _sample(sampler, tokenizer, 1, version * 100 + i + 50)  # it is there now
                warm.append(time.perf_counter() - started)
        nbytes = snapshot.num_bytes
    finally:
        for sampler in samplers:
            sampler.close()

    def median(values):
        return round(sorted(values)[len(values) // 2], 4)

    print(
        json.dumps(
            {
                "measure": "adapter_update",
                "runs_on_one_engine": runs,
                "updates": updates,
                "adapter_bytes": nbytes,
                "publish_s": median(publish),
                "load_s": median(load),
                "first_group_s": median(first),
                "group_with_adapter_loaded_s": median(warm),
                "swap_s": round(median(first) - median(warm), 4),
                "per_adapter_per_update_s": round(median(publish) + median(load) + median(first) - median(warm), 4),
            }
        ),
        flush=True,
    )


def _one_run(groups: int, seed: int, go: Path) -> None:
    """A run with an engine of its own (a separate fleet): start it, wait for ``go``, sample, print the times."""
    model_dir, tokenizer = _model()
    sampler = _sampler(model_dir, tokenizer, f"run-{seed}", max_loras=1)
    sampler.load_snapshot(_snapshot(model_dir, seed), 1)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.05)
    started = time.time()
    tokens = _sample(sampler, tokenizer, groups, seed * 1000)
    print(json.dumps({"started": started, "ended": time.time(), "tokens": tokens}), flush=True)
    sampler.close()


def _snapshot(model_dir: Path, seed: int) -> list[str]:
    from common.weights import WeightStore

    store = WeightStore(Path(tempfile.mkdtemp(prefix="fleet-bench-")))
    return list(store.save("actor", 1, _learner(model_dir, seed)).chain)


def throughput(runs: list[int], groups: int) -> None:
    """Tokens/s of N runs sampling ``groups`` groups each: on one shared engine (their requests interleaved, an
    adapter each, N slots), and on N engines of their own started as separate processes on the same cores."""
    model_dir, tokenizer = _model()
    for n in runs:
        samplers = [_sampler(model_dir, tokenizer, f"run-{i}", max_loras=n) for i in range(n)]
        for i, sampler in enumerate(samplers):
            sampler.load_snapshot(_snapshot(model_dir, i), 1)
        prompt = tokenizer(PROMPT)["input_ids"]
        from common.sampling import SamplingParams

        started = time.perf_counter()
        for i, sampler in enumerate(samplers):
            for g in range(groups):
                params = SamplingParams(n=4, max_new_tokens=32, temperature=1.0, seed=i * 1000 + g)
                sampler.submit(f"{i}/{g}", prompt, params)
        tokens = 0
        while any(sampler.in_flight() for sampler in samplers):
            for sampler in samplers:
                if sampler.in_flight():
                    tokens += sum(int(s.response_lengths.sum()) for _, s in sampler.step(0.2))
        shared_s = time.perf_counter() - started
        for sampler in samplers:
            sampler.close()

        go = Path(tempfile.mkdtemp(prefix="fleet-go-")) / "go"
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
        processes = [
            subprocess.Popen(
                [sys.executable, __file__, "_one", str(groups), str(i), str(go)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            for i in range(n)
        ]
        for process in processes:
            _line_of(process, lambda line: line == "ready")
        go.touch()
        results = [json.loads(_line_of(process, lambda line: line.startswith('{"started"'))) for process in processes]
        for process in processes:
            process.wait()
        separate_s = max(r["ended"] for r in results) - min(r["started"] for r in results)
        separate_tokens = sum(r["tokens"] for r in results)
        print(
            json.dumps(
                {
                    "measure": "throughput",
                    "runs": n,
                    "groups_per_run": groups,
                    "shared_engine_tokens_per_s": round(tokens / shared_s, 1),
                    "separate_engines_tokens_per_s": round(separate_tokens / separate_s, 1),
                    "ratio": round((tokens / shared_s) / (separate_tokens / separate_s), 2),
                    "engines_memory": f"1 against {n}",
                }
            ),
            flush=True,
        )


def _line_of(process: subprocess.Popen, wanted) -> str:
    """The next line of ``process``'s output that is ``wanted`` (vLLM logs on the same stream)."""
    for line in process.stdout:
        if wanted(line.strip()):
            return line.strip()
    raise RuntimeError(f"a run's process ended (exit {process.wait()}) before it said what was wanted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("adapters")
    a.add_argument("--runs", type=int, default=4)
    a.add_argument("--updates", type=int, default=5)
    t = sub.add_parser("throughput")
    t.add_argument("--runs", type=int, nargs="+", default=[1, 2, 4])
    t.add_argument("--groups", type=int, default=16)
    one = sub.add_parser("_one")
    one.add_argument("groups", type=int)
    one.add_argument("seed", type=int)
    one.add_argument("go", type=Path)
    args = parser.parse_args()
    if args.command == "adapters":
        adapters(args.runs, args.updates)
    elif args.command == "throughput":
        throughput(args.runs, args.groups)
    else:
        _one_run(args.groups, args.seed, args.go)


if __name__ == "__main__":
    main()
