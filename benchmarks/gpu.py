"""A few PPO steps of a ~0.5B model on one GPU, then the sharded (FSDP2) learner with one rank per GPU.

Reports learner tokens/s, model FLOPs utilisation, generation tokens/s and peak memory, for the single-process
learner and for the FSDP learner; the seconds for one actor update (bf16 on GPU) to reach a generator's model on the
same machine by the store and by the broadcast (``weights.broadcast``), side by side; and the seconds to write a
snapshot, whole and sharded, from the FSDP learner.

The model is built from a config (Qwen2.5-0.5B's shape, random weights: no hub is needed), the generator is the
transformers backend (no vLLM assumed), and the learner is streamppo's own PPOTrainer, so the numbers are those
of the code the services run. Prints JSON and writes it to ``--out``; merge it into RESULTS.md with
``python -m benchmarks.run --only '' --gpu-results gpu.json``.

    python benchmarks/gpu.py --out gpu.json                      # on the GPU machine (FSDP over every GPU)
    python benchmarks/gpu.py --device cpu --small --fsdp-ranks 2 --out cpu.json  # a smoke run anywhere

On a GPU machine without the network or streamppo's packages, ``benchmarks/gpu.sh`` brings them as wheels.

FLOPs are counted as 2·N per token forward and 6·N forward+backward (N = parameters without the embedding;
attention's own FLOPs are left out), over what one PPO update computes: π_old recomputation (actor forward),
``ppo_epochs`` × (actor forward+backward + critic forward+backward).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.weight_paths import StorePath, broadcast_paths, interleaved, scratch_dir  # noqa: E402
from common.config import AlgorithmSection, LearnerSection  # noqa: E402
from common.generation import sample_responses  # noqa: E402
from common.models import load_actor, load_critic  # noqa: E402
from common.sampling import SamplingParams  # noqa: E402
from common.storage import state_nbytes  # noqa: E402
from common.weights import WeightStore  # noqa: E402
from services.learner.experience import Experience
from services.learner.parallel import init_ranks, shard_model  # noqa: E402
from services.learner.trainer import PPOTrainer  # noqa: E402

QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
SMALL = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense, no sparsity


def peak_tflops(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a small model, for a smoke run")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples-per-prompt", dest="n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("gpu.json"))
    parser.add_argument(
        "--fsdp-ranks", type=int, default=None, help="ranks of the FSDP phase (default: every GPU; 0 skips it)"
    )
    parser.add_argument("--rank-phase", type=Path, help=argparse.SUPPRESS)  # internal: one rank of the FSDP phase
    args = parser.parse_args()
    if args.rank_phase is not None:
        return fsdp_rank(args)
    from transformers import LlamaConfig, Qwen2Config

    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    config = LlamaConfig(**SMALL) if args.small else Qwen2Config(**QWEN25_05B)
    config.pad_token_id, config.eos_token_id = 0, 1
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        actor = load_actor(Path(tmp), dtype, device=args.device)
        critic = load_critic(Path(tmp), dtype, device=args.device)
        generator_copy = load_actor(Path(tmp), dtype, device=args.device)  # the generator's model, for the updates
    params = sum(p.numel() for p in actor.parameters())
    non_embedding = params - actor.get_input_embeddings().weight.numel()
    learner = LearnerSection(ppo_epochs=2, mini_batch_size=32, micro_batch_size=16, actor_lr=1e-6, critic_lr=1e-6)
    trainer = PPOTrainer(actor, critic, learner, AlgorithmSection(), 1.0, pad_token_id=0, seed=0)
    sampling = SamplingParams(n=args.n, max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    generator = torch.Generator().manual_seed(0)

    generated, gen_seconds, trained, train_seconds, flops = 0, 0.0, 0, 0.0, 0.0
    for step in range(args.steps + 1):  # step 0 warms up (kernels, allocator) and is not counted
        prompts = torch.randint(2, config.vocab_size, (args.prompts, args.prompt_tokens), generator=generator)
        lengths = torch.full((args.prompts,), args.prompt_tokens)
        sync(args.device)
        started = time.perf_counter()
        samples = sample_responses(actor, prompts, lengths, sampling, eos_token_id=1, pad_token_id=0)
        sync(args.device)
        seconds = time.perf_counter() - started
        rows = samples.group_index
        n, width = samples.response_tokens.shape
        exp = Experience(
            torch.full((len(rows),), step),
            prompts[rows],
            lengths[rows],
            samples.response_tokens,
            samples.response_lengths,
            samples.finished,
            samples.behaviour_logprobs,
            torch.randn(n),
            torch.zeros(n, width),
            torch.zeros(n, width),
            torch.randn(n, width),
            torch.randn(n, width),
        )
        tokens = int(lengths[rows].sum() + samples.response_lengths.sum())
        sync(args.device)
        started_train = time.perf_counter()
        trainer.version = step
        trainer.train(exp)
        sync(args.device)
        train_s = time.perf_counter() - started_train
        if step > 0:
            generated += int(samples.response_lengths.sum())
            gen_seconds += seconds
            trained += tokens
            train_seconds += train_s
            flops += tokens * non_embedding * (2 + learner.ppo_epochs * (6 + 6))
    try:  # a failure here must not lose the numbers above: the GPU machine is lent for minutes
        updates = update_paths(trainer, generator_copy, dtype, args.device)
    except Exception as exc:
        updates = {"actor update: error": f"{type(exc).__name__}: {exc}"}
    peak = peak_tflops(args.device)
    achieved = flops / train_seconds / 1e12
    result = {
        "setup": (
            f"{'small Llama' if args.small else 'Qwen2.5-0.5B-shaped'} model ({params / 1e6:.0f}M parameters, "
            f"random weights, {dtype}), {args.steps} PPO steps of {args.prompts}×{args.n} sequences, "
            f"{args.prompt_tokens} prompt + up to {args.new_tokens} new tokens, transformers generate, "
            f"PPOTrainer with ppo_epochs 2, mini-batch 32, micro-batch 16"
        ),
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device,
        "results": {
            "generation tokens/s": generated / gen_seconds,
            "learner tokens/s (prompt+response, per update)": trained / train_seconds,
            "learner achieved TFLOP/s (6N/2N count)": achieved,
            "learner MFU vs dense bf16 peak": achieved / peak if peak else "n/a (unknown peak)",
            "seconds per step: generation": gen_seconds / args.steps,
            "seconds per step: PPO update": train_seconds / args.steps,
            "peak GPU memory (GiB)": (
                torch.cuda.max_memory_allocated(args.device) / 2**30 if args.device.startswith("cuda") else "n/a"
            ),
            **updates,
        },
    }
    ranks = args.fsdp_ranks if args.fsdp_ranks is not None else torch.cuda.device_count()
    if ranks:
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # kept if the FSDP phase runs out of time
        result["fsdp"] = run_fsdp_phase(args, ranks, non_embedding)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def publish(trainer: PPOTrainer, dtype: str) -> dict:
    """Seconds to gather the actor's state and write it as a snapshot (the learner's side of the store path)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = WeightStore(Path(tmp))
        started = time.perf_counter()
        state = trainer.full_state("actor", dtype)
        gathered = time.perf_counter()
        snapshot = store.save_state("actor", 1, state)
        published = time.perf_counter()
    return {
        f"snapshot ({dtype}) MB": snapshot.num_bytes / 1e6,
        "snapshot seconds: gather": gathered - started,
        "snapshot seconds: write + digest": published - gathered,
    }


def update_paths(trainer: PPOTrainer, into: torch.nn.Module, dtype: str, device: str, rounds: int = 3) -> dict:
    """Seconds for one actor update to reach a generator's model on this machine, by the store and by the
    broadcast (``weights.broadcast``: gloo, staged in host memory), as the learner and a transformers generator run
    them (``benchmarks/weight_paths.py``, the same code as the CPU benchmark). Gather (the learner's state to host
    memory) is the same for every path; publish is the learner's side, load until ``into`` holds the version on the
    device. Median of ``rounds``, the paths taking turns."""
    started = time.perf_counter()
    state = trainer.full_state("actor", dtype)
    gather = time.perf_counter() - started
    nbytes = state_nbytes(state)

    def synced(load):
        return lambda: (load(), sync(device))

    with scratch_dir(6 * nbytes) as tmp:  # up to three snapshots in each of two stores
        paths = {"store (blake3)": StorePath(Path(tmp), state, into).timed}
        with broadcast_paths(Path(tmp), state, into) as broadcast:
            paths |= broadcast
            measured = interleaved({k: (publish_fn, synced(load)) for k, (publish_fn, load) in paths.items()}, rounds)
    out = {f"actor update ({dtype}) MB": nbytes / 1e6, "actor update seconds: gather to host": gather}
    for label, (publish_s, load_s) in measured.items():
        label = label.removeprefix("after, blake3, ")
        out[f"actor update by {label}: publish s"] = publish_s
        out[f"actor update by {label}: load s"] = load_s
        out[f"actor update by {label}: gather + publish + load s"] = gather + publish_s + load_s
    return out


def publish_sharded(trainer: PPOTrainer, dtype: str) -> dict:
    """Seconds to write the actor as a sharded snapshot: every rank gathers and writes its part, rank 0 the index."""
    with tempfile.TemporaryDirectory() as tmp:
        store = WeightStore(Path(tmp))
        started = time.perf_counter()
        snapshot = store.save_sharded(
            "actor", 1, lambda folder: trainer.write_snapshot_parts("actor", dtype, folder, store.digest)
        )
        written = time.perf_counter() - started
    return {
        f"sharded snapshot ({dtype}) MB": snapshot.num_bytes / 1e6,
        "sharded snapshot seconds: gather + write parts + index": written,
    }


def synthetic_experience(args, vocab: int, version: int) -> Experience:
    """A batch shaped like the generation phase's, with random tokens and full-length responses."""
    g = torch.Generator().manual_seed(version)
    n = args.prompts * args.n
    width = args.new_tokens
    return Experience(
        torch.full((n,), version),
        torch.randint(2, vocab, (n, args.prompt_tokens), generator=g),
        torch.full((n,), args.prompt_tokens),
        torch.randint(2, vocab, (n, width), generator=g),
        torch.full((n,), width),
        torch.zeros(n, dtype=torch.bool),
        -torch.rand(n, width, generator=g),
        torch.randn(n, generator=g),
        torch.zeros(n, width),
        torch.zeros(n, width),
        torch.randn(n, width, generator=g),
        torch.randn(n, width, generator=g),
    )


def run_fsdp_phase(args, ranks: int, non_embedding: int) -> dict:
    """The same updates with the FSDP learner over ``ranks`` ranks (torch's launcher, one rank per GPU)."""
    import os
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        command += [str(Path(__file__).resolve()), "--rank-phase", str(out), "--device", args.device]
        command += [f"--steps={args.steps}", f"--prompts={args.prompts}", f"--samples-per-prompt={args.n}"]
        command += [f"--prompt-tokens={args.prompt_tokens}", f"--new-tokens={args.new_tokens}"]
        command += ["--small"] if args.small else []
        env = dict(os.environ) | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            return {"error": result.stderr[-2000:]}
        measured = json.loads(out.read_text())
    tokens, seconds = measured.pop("tokens"), measured.pop("train_seconds")
    achieved = tokens * non_embedding * (2 + 2 * (6 + 6)) / seconds / 1e12
    peak = peak_tflops(args.device)
    return {
        "ranks": ranks,
        "learner tokens/s (all ranks)": tokens / seconds,
        "seconds per step: PPO update": seconds / args.steps,
        "learner achieved TFLOP/s (all ranks)": achieved,
        "learner MFU vs dense bf16 peak (per GPU)": achieved / (peak * ranks) if peak else "n/a (unknown peak)",
        **measured,
    }


def fsdp_rank(args) -> int:
    """One rank of the FSDP phase: synthetic experience (generation was measured already), rank 0 leads."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    ranks = init_ranks("fsdp", 2, args.device)
    compute = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    config = LlamaConfig(**SMALL) if args.small else Qwen2Config(**QWEN25_05B)
    config.pad_token_id, config.eos_token_id = 0, 1
    folder = args.rank_phase.parent / "model"
    if ranks.leads:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    ranks.barrier()
    device = str(ranks.device)
    actor = shard_model(load_actor(folder, "float32", device=device), ranks, compute)
    critic = shard_model(load_critic(folder, "float32", device=device), ranks, compute)
    learner = LearnerSection(ppo_epochs=2, mini_batch_size=32, micro_batch_size=16, actor_lr=1e-6, critic_lr=1e-6)
    trainer = PPOTrainer(actor, critic, learner, AlgorithmSection(), 1.0, pad_token_id=0, seed=0, ranks=ranks)
    if not ranks.leads:
        ranks.follow(trainer)
        return 0
    tokens, seconds = 0, 0.0
    for step in range(args.steps + 1):
        exp = synthetic_experience(args, config.vocab_size, step)
        trainer.version = step
        sync(device)
        started = time.perf_counter()
        trainer.train(exp)
        sync(device)
        if step > 0:
            seconds += time.perf_counter() - started
            tokens += int(exp.prompt_lengths.sum() + exp.response_lengths.sum())
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    publish_load = publish(trainer, dtype) | publish_sharded(trainer, dtype)
    trainer.release()
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.startswith("cuda") else "n/a"
    args.rank_phase.write_text(
        json.dumps({"tokens": tokens, "train_seconds": seconds, "peak GPU memory rank 0 (GiB)": memory, **publish_load})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
