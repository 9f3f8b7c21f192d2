"""Where scores come from, and the one factory that makes a run's reward (:func:`load_reward`) for the scorer,
``streamppo rescore`` and the checks made before a run starts (:func:`check_reward`).

Three kinds, as ``reward`` names them: a function of yours (:class:`~.base.RewardFunction`), a reward model
(:class:`~.base.RewardModelScorer`, a one-label sequence classifier) or a judge (:class:`~.judge.JudgeScorer`, a
language model that writes a score). Each is called with ``(prompts, responses, labels)`` and returns one finite
score per response, and each has ``close()``, which releases what it holds (a judge's engine, a reward model shared
by the runs of a fleet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.models import FrozenModels, load_reward_model, load_tokenizer, resolve_model
from common.rewards.base import (
    RewardError,
    RewardFunction,
    RewardModelScorer,
    checked_scores,
    encode_pairs,
    load_reward_function,
)
from common.rewards.judge import JudgeScorer, judge_id, judge_writer

if TYPE_CHECKING:
    from common.config import RunConfig

__all__ = [
    "JudgeScorer",
    "Reward",
    "RewardError",
    "RewardFunction",
    "RewardModelScorer",
    "check_reward",
    "checked_scores",
    "encode_pairs",
    "load_reward",
    "load_reward_function",
]

Reward = RewardFunction | RewardModelScorer | JudgeScorer


def load_reward(config: RunConfig) -> tuple[Reward, dict]:
    """The reward ``config.reward`` names (a function, a judge or a reward model), and the lineage that says which it
    is (carried by every scored record)."""
    m = config.model
    if config.reward.function is not None:
        return RewardFunction(config.reward.function), {"reward.function": config.reward.function}
    if config.reward.judge is not None:
        judge = config.reward.judge
        judge_path = resolve_model(judge.model, m.cache_dir)
        write = judge_writer(judge, judge_path, m.dtype_of("reward"), m.device, m.trust_remote_code, config.run.seed)
        scorer = JudgeScorer(
            write,
            judge.template,
            judge.pattern,
            judge.on_unparsed,
            judge.default_score,
            config.reward.batch_size,
            name=f"judge {judge_path.name}",
        )
        return scorer, {"reward.judge": judge_id(judge_path, judge.template, judge.pattern)}
    rm_path = resolve_model(config.reward.model, m.cache_dir)
    key = ("reward model", str(rm_path), m.dtype_of("reward"), m.trust_remote_code, m.device)
    model = FrozenModels.acquire(
        key, lambda: load_reward_model(rm_path, m.dtype_of("reward"), m.trust_remote_code, m.device)
    )
    tokenizer = load_tokenizer(rm_path, m.trust_remote_code)
    release = lambda: FrozenModels.release(key)  # noqa: E731
    scorer = RewardModelScorer(model, tokenizer, batch_size=config.reward.batch_size, release=release)
    return scorer, {"reward.model": str(rm_path)}


def check_reward(config: RunConfig) -> None:
    """What :func:`load_reward` would fail on, found without loading a model: the function loads, the judge's or the
    reward model's folder is there (a builtin one made into the cache). Raises what the load would."""
    m = config.model
    if config.reward.function is not None:
        load_reward_function(config.reward.function)
    elif config.reward.judge is not None:
        resolve_model(config.reward.judge.model, m.cache_dir)
    else:
        resolve_model(config.reward.model, m.cache_dir)
