"""A synthetic experience batch of a given size, for the benchmarks that measure moving one (codec, transport,
batch store)."""

import numpy as np

from common.schema import ExperienceBatch, new_header


def experience_batch(n=64, t=512, p=64) -> ExperienceBatch:
    rng = np.random.default_rng(0)
    f = lambda: rng.standard_normal((n, t), dtype=np.float32)  # noqa: E731
    return ExperienceBatch(
        **new_header("bench-0", "bench", 3, {"run.id": "bench"}),
        step=0,
        group_index=np.arange(n),
        prompt_text=["an opinion about a film"] * n,
        prompt_label=[""] * n,
        response_text=["a response " * 40] * n,
        prompt_tokens=rng.integers(0, 49152, (n, p)),
        prompt_lengths=np.full(n, p),
        response_tokens=rng.integers(0, 49152, (n, t)),
        response_lengths=np.full(n, t),
        finished=np.ones(n, bool),
        behaviour_logprobs=f(),
        token_versions=np.full((n, t), 3, np.int32),
        response_mask=np.ones((n, t), bool),
        turns=np.ones(n, np.int64),
        environment_reward=np.zeros(n, np.float32),
        dead_lettered_groups=np.zeros(0, np.int64),
        scores=rng.standard_normal(n).astype(np.float32),
        ref_logprobs=f(),
        values=f(),
        kl=f(),
        token_rewards=f(),
        advantages=f(),
        returns=f(),
        no_signal_groups=np.zeros(0, dtype=np.int64),
    )
