"""Cost profiles for the simulated cluster: how long each model call would take on real accelerators.

A profile prices one step of a batch shape at each stage, with one accelerator set per service. Every figure comes
from a published measurement (``SOURCES``); RESULTS.md prints the derivation next to the tables. These numbers are
for the simulated benchmarks alone: nothing in ``common/`` or ``services/`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SOURCES = {
    "prime-rl": "prime-rl BENCHMARKS.md: trainer, Qwen3-0.6B on one H100, 11.9k tokens/s (11.1% MFU)",
    "verl-quickstart": "verl quickstart: PPO, Qwen2.5-0.5B-Instruct, GSM8K, one GPU, batch 256, 512/512 tokens, "
    "~68 s per step",
    "verl-sync": "verl one-step-off README: 7B weight sync 0.12 s over NCCL (4 trainer : 4 rollout GPUs)",
    "h200": "H200: 989 TFLOP/s bf16 dense (same as H100), 4.8 TB/s HBM; a 7B bf16 snapshot (15.2 GB) reads from "
    "NVMe in ~2 s",
}

# Derived rates, one accelerator each (see derivation()):
TRAIN_TOKENS_PER_S = 11_900  # fwd + bwd of a ~0.5B model, per model (prime-rl, 0.6B on H100; H200: same peak)
FORWARD_TOKENS_PER_S = 3 * TRAIN_TOKENS_PER_S  # a forward pass is 2N of the 6N FLOPs per token of fwd + bwd
NVME_BYTES_PER_S = 15.2e9 / 2.0  # snapshot write/read through local NVMe (h200)
QWEN_0_5B_BYTES = 494_000_000 * 2  # Qwen2.5-0.5B in bf16


@dataclass(frozen=True)
class CostProfile:
    """One step's batch shape and each stage's seconds for it, on the accelerators the profile names.

    Stage seconds are for a batch whose responses all have ``response_tokens`` tokens; a batch of other lengths is
    priced by :class:`CostModel` (generation by its longest response, the other stages by their tokens).
    """

    name: str
    about: str
    prompts: int  # prompt batch (B)
    n: int  # responses per prompt
    prompt_tokens: int
    response_tokens: int  # the mean response length
    max_response_tokens: int
    generate_s: float  # generator: one batch (every decode step waits for the batch's longest response)
    score_s: float  # scorer: reference log-probs + reward model
    critic_s: float  # advantage: critic values
    train_s: float  # learner: π_old + actor and critic updates
    weight_bytes: int  # the actor snapshot, written by the learner and read by each generator per update
    long_tail_sigma: float = 0.0  # σ of log-normal response lengths of mean response_tokens; 0: all equal
    jitter: float = 0.05  # σ of a log-normal factor on every call's seconds

    @property
    def weight_sync_s(self) -> float:
        """Seconds to write (learner) or read (generator) one snapshot through NVMe."""
        return self.weight_bytes / NVME_BYTES_PER_S

    def stage_seconds(self, streaming: bool = False) -> dict[str, float]:
        """Each stage's mean seconds per step, weight writes and reads included, as the ideal bound counts them.
        Generation waits for a batch's longest response, or ``streaming`` (continuous batching) pays the mean."""
        model = CostModel(self, scale=1.0, seed=0, jitter=False)
        samples = [model.response_lengths(np.random.default_rng(i)) for i in range(200)]
        generate = model.generate_streaming_s if streaming else model.generate_s
        return {
            "generator": float(np.mean([generate(s) for s in samples])) + self.weight_sync_s,
            "scorer": float(np.mean([model.score_s(s) for s in samples])),
            "advantage": float(np.mean([model.critic_s(s) for s in samples])),
            "learner": float(np.mean([model.train_s(s) for s in samples])) + self.weight_sync_s,
        }


def _verl_quickstart_split() -> dict[str, float]:
    """verl's 68 s single-GPU step (batch 256, 512 + 512 tokens) split by stage at the prime-rl rates.

    Tokens per step: 256 × 1024. Learner: π_old (a forward) + actor and critic updates (fwd + bwd each); scorer:
    the reference forward (GSM8K's reward is a rule); advantage: the critic forward. Generation is the rest of 68 s.
    """
    tokens = 256 * 1024
    forward, update = tokens / FORWARD_TOKENS_PER_S, tokens / TRAIN_TOKENS_PER_S
    split = {"score_s": forward, "critic_s": forward, "train_s": forward + 2 * update}
    split["generate_s"] = 68.0 - sum(split.values())
    return split


_SHAPE = dict(prompts=64, n=4, prompt_tokens=512, response_tokens=512, max_response_tokens=512)
_7B_SHAPE = dict(prompts=128, n=8, prompt_tokens=1024, response_tokens=2048, max_response_tokens=2048)


def _scaled_from_0_5b(factor: float, shape: dict) -> dict[str, float]:
    """The 0.5B profile's seconds per token × ``factor``, for a batch of ``shape``. Generation: a decode step's
    seconds scale with the model, the steps with the response length."""
    split = _verl_quickstart_split()
    base_tokens = _SHAPE["prompts"] * _SHAPE["n"] * (_SHAPE["prompt_tokens"] + _SHAPE["response_tokens"])
    tokens = shape["prompts"] * shape["n"] * (shape["prompt_tokens"] + shape["response_tokens"])
    stages = {k: split[k] / base_tokens * factor * tokens for k in ("score_s", "critic_s", "train_s")}
    stages["generate_s"] = split["generate_s"] / _SHAPE["response_tokens"] * factor * shape["response_tokens"]
    return stages


PROFILES: dict[str, CostProfile] = {
    p.name: p
    for p in (
        CostProfile(
            "0.5b-h200",
            "verl quickstart's PPO step (Qwen2.5-0.5B, batch 256, 512/512) split by stage, one H200 per service",
            **_SHAPE,
            **_verl_quickstart_split(),
            weight_bytes=QWEN_0_5B_BYTES,
        ),
        CostProfile(
            "0.5b-balanced",
            "the same 68 s of work with accelerators shared out so that every stage takes a quarter (17 s)",
            **_SHAPE,
            generate_s=17.0,
            score_s=17.0,
            critic_s=17.0,
            train_s=17.0,
            weight_bytes=QWEN_0_5B_BYTES,
        ),
        CostProfile(
            "0.5b-generation-heavy",
            "the same 68 s with generation half of it (long answers): 34 s, the other stages 11.3 s each",
            **_SHAPE,
            generate_s=34.0,
            score_s=34.0 / 3,
            critic_s=34.0 / 3,
            train_s=34.0 / 3,
            weight_bytes=QWEN_0_5B_BYTES,
        ),
        CostProfile(
            "0.5b-long-tail",
            "0.5b-balanced with log-normal response lengths (σ 1, mean 512, up to 2,048): each generation step "
            "waits for the batch's longest answer",
            **{**_SHAPE, "max_response_tokens": 2048},
            generate_s=17.0,
            score_s=17.0,
            critic_s=17.0,
            train_s=17.0,
            weight_bytes=QWEN_0_5B_BYTES,
            long_tail_sigma=1.0,
        ),
        CostProfile(
            "7b-8xh200",
            "a 7B model on 8 H200 per service: batch 128 × 8, 1,024 prompt and 2,048 response tokens; the 0.5B "
            "rates scaled by parameters (×14) and GPUs (÷8)",
            **_7B_SHAPE,
            **_scaled_from_0_5b(14 / 8, _7B_SHAPE),
            weight_bytes=int(15.2e9),
        ),
    )
}


class CostModel:
    """Seconds for each model call of one batch, from a profile: × ``scale`` (so that a benchmark runs in minutes)
    and × a log-normal jitter per call."""

    def __init__(self, profile: CostProfile, scale: float, seed: int, jitter: bool = True):
        self.profile, self.scale = profile, scale
        self.rng = np.random.default_rng(seed)
        self.jitter = jitter

    def response_lengths(self, rng: np.random.Generator | None = None, count: int | None = None) -> np.ndarray:
        """``(count,)`` response lengths in ``1 .. max_response_tokens`` (default: a batch's, B·n)."""
        p, rng = self.profile, rng or self.rng
        count = count or p.prompts * p.n
        if p.long_tail_sigma == 0:
            return np.full(count, p.response_tokens, dtype=np.int64)
        sigma = p.long_tail_sigma
        mu = np.log(p.response_tokens) - sigma**2 / 2  # a log-normal of mean response_tokens
        return np.clip(rng.lognormal(mu, sigma, count).round(), 1, p.max_response_tokens).astype(np.int64)

    def _seconds(self, seconds: float) -> float:
        factor = self.rng.lognormal(0.0, self.profile.jitter) if self.jitter else 1.0
        return seconds * factor * self.scale

    def _token_share(self, lengths: np.ndarray) -> float:
        p = self.profile
        return float(np.sum(lengths + p.prompt_tokens)) / (p.prompts * p.n * (p.prompt_tokens + p.response_tokens))

    def generate_s(self, lengths: np.ndarray) -> float:
        return self._seconds(self.profile.generate_s * int(lengths.max()) / self.profile.response_tokens)

    def generate_streaming_s(self, lengths: np.ndarray) -> float:
        """A batch's share of a continuous-batching engine's time: its mean length, not its longest."""
        return self._seconds(self.profile.generate_s * float(lengths.mean()) / self.profile.response_tokens)

    def score_s(self, lengths: np.ndarray) -> float:
        return self._seconds(self.profile.score_s * self._token_share(lengths))

    def critic_s(self, lengths: np.ndarray) -> float:
        return self._seconds(self.profile.critic_s * self._token_share(lengths))

    def train_s(self, lengths: np.ndarray) -> float:
        return self._seconds(self.profile.train_s * self._token_share(lengths))

    def weight_sync_s(self) -> float:
        return self._seconds(self.profile.weight_sync_s)


def derivation() -> list[str]:
    """How the profiles' seconds follow from the published figures, one line each, for RESULTS.md."""
    split = _verl_quickstart_split()
    return [
        f"training {TRAIN_TOKENS_PER_S:,} tokens/s per model per GPU (prime-rl); a forward pass 3× that "
        f"({FORWARD_TOKENS_PER_S:,}/s: 2N of 6N FLOPs per token)",
        "0.5b-h200: verl's 68 s step less the learner (π_old forward + actor and critic updates: "
        f"{split['train_s']:.1f} s), the reference forward ({split['score_s']:.1f} s) and the critic forward "
        f"({split['critic_s']:.1f} s) leaves generation {split['generate_s']:.1f} s (verl-quickstart, prime-rl)",
        f"weights: Qwen2.5-0.5B in bf16 is {QWEN_0_5B_BYTES / 1e9:.2f} GB; a snapshot is written and read at "
        f"{NVME_BYTES_PER_S / 1e9:.1f} GB/s (h200: 15.2 GB in ~2 s from NVMe), "
        f"{PROFILES['0.5b-h200'].weight_sync_s:.2f} s each way at 0.5B, {PROFILES['7b-8xh200'].weight_sync_s:.1f} s "
        "at 7B (a broadcast would take 0.12 s at 7B: verl-sync)",
    ]
