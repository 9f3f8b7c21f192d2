"""A generative reward (``reward.judge``): a language model reads the prompt, the answer and the label, and writes
a score, which a regular expression reads.

The judge writes greedily (temperature 0), so the same answer gets the same score. Its text may hold no score: the
configuration says whether that answer then gets ``default_score`` or its batch goes to the dead letters
(``on_unparsed``); either way it is counted. Two backends write the text: vLLM (a second engine in the scorer) and
transformers' ``generate`` (the fallback, and the choice where vLLM is not installed).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from common.rewards.base import RewardError, checked_scores

__all__ = ["JudgeScorer", "TransformersJudge", "VllmJudge", "judge_id", "judge_writer", "parse_score"]

log = logging.getLogger(__name__)

Writer = Callable[[list[str]], list[str]]  # judge prompts → the judge's texts, one each


def parse_score(text: str, pattern: re.Pattern) -> float | None:
    """The score in the judge's text: the first group of ``pattern``'s first match, as a float; None if there is
    none (no match, or one that is not a finite number)."""
    match = pattern.search(text)
    if match is None:
        return None
    try:
        value = float(match.group(1))
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class JudgeScorer:
    """Scores answers with a judge: the template filled with each (prompt, response, label), the judge's texts
    written in batches by ``write``, each parsed with ``pattern``."""

    def __init__(
        self,
        write: Writer,
        template: str,
        pattern: str,
        on_unparsed: str = "default",
        default_score: float = 0.0,
        batch_size: int = 16,
        name: str = "judge",
    ):
        self.write, self.template, self.pattern = write, template, re.compile(pattern)
        self.on_unparsed, self.default_score = on_unparsed, default_score
        self.batch_size, self.name = batch_size, name
        self.unparsed = 0  # answers whose judge's text held no score, over the scorer's life
        self.last_texts: list[str] = []  # the judge's texts of the last call
        self.last_unparsed = 0  # and how many of them held no score

    def close(self) -> None:
        """Shut the judge's engine down (a vLLM judge's processes)."""
        close = getattr(self.write, "close", None)
        if close is not None:
            close()

    def last_call(self) -> dict:
        """What the scored record's lineage says of the last call: how many of its answers got the default score."""
        return {"reward.judge.unparsed": self.last_unparsed}

    def prompts(self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str]) -> list[str]:
        labels = list(labels) or [""] * len(responses)
        return [self.template.format(prompt=p, response=r, label=lb) for p, r, lb in zip(prompts, responses, labels)]

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str] = ()) -> torch.Tensor:
        judge_prompts = self.prompts(prompts, responses, labels)
        texts: list[str] = []
        for start in range(0, len(judge_prompts), self.batch_size):
            texts += self.write(judge_prompts[start : start + self.batch_size])
        if len(texts) != len(judge_prompts):
            raise RewardError(f"{self.name} wrote {len(texts)} texts for {len(judge_prompts)} answers")
        self.last_texts = texts
        scores = [parse_score(text, self.pattern) for text in texts]
        missing = [i for i, score in enumerate(scores) if score is None]
        self.unparsed += len(missing)
        self.last_unparsed = len(missing)
        if missing and self.on_unparsed == "dead_letter":
            raise RewardError(
                f"{self.name} wrote no score for {len(missing)} of {len(texts)} answers (pattern "
                f"{self.pattern.pattern!r}), e.g. {texts[missing[0]][:200]!r}"
            )
        if missing:
            log.warning(
                "%s wrote no score for %d of %d answers; they get %s (e.g. %r)",
                self.name,
                len(missing),
                len(texts),
                self.default_score,
                texts[missing[0]][:200],
            )
        values = [self.default_score if score is None else score for score in scores]
        return checked_scores(values, len(responses), self.name)


class TransformersJudge:
    """The judge's texts by transformers' ``generate``, greedy, left-padded batches."""

    def __init__(self, model, tokenizer, max_new_tokens: int, chat: bool):
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.chat = max_new_tokens, chat
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> list[str]:
        texts = [_as_chat(self.tokenizer, p) for p in prompts] if self.chat else prompts
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not self.chat)
        enc = enc.to(self.model.device)
        out = self.model.generate(
            **enc,
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        return self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


class VllmJudge:
    """The judge's texts by a vLLM engine of its own, greedy."""

    def __init__(self, model_dir: Path, dtype: str, judge, seed: int):
        """``judge``: the ``reward.judge`` section (its engine's KV cache, longest sequence, text length, chat)."""
        from vllm import LLM

        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            kv_cache_memory_bytes=int(judge.kv_cache_gib * 2**30),
            max_model_len=judge.max_model_len,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.max_new_tokens, self.chat = judge.max_new_tokens, judge.chat

    def __call__(self, prompts: list[str]) -> list[str]:
        from vllm import SamplingParams

        texts = [_as_chat(self.tokenizer, p) for p in prompts] if self.chat else prompts
        params = SamplingParams(temperature=0.0, max_tokens=self.max_new_tokens)
        return [out.outputs[0].text for out in self.llm.generate(texts, params, use_tqdm=False)]

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def _as_chat(tokenizer, prompt: str) -> str:
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def judge_writer(judge, model_dir: Path, dtype: str, device: str, trust_remote_code: bool, seed: int) -> Writer:
    """The writer ``judge`` (a ``reward.judge`` section) asks for: vLLM where chosen or, with ``auto``, installed;
    transformers otherwise."""
    backend = judge.backend
    if backend == "auto":
        try:
            import vllm  # noqa: F401

            backend = "vllm"
        except ImportError:
            backend = "transformers"
            log.info("judge: vLLM is not installed; the judge writes with transformers")
    if backend == "vllm":
        return VllmJudge(model_dir, dtype, judge, seed)
    from common.models import load_actor, load_tokenizer

    model = load_actor(model_dir, dtype, trust_remote_code, role="judge", device=device).requires_grad_(False)
    tokenizer = load_tokenizer(model_dir, trust_remote_code)
    return TransformersJudge(model.eval(), tokenizer, judge.max_new_tokens, judge.chat)


def judge_id(model_dir: Path, template: str, pattern: str) -> str:
    """What names a judge in the lineage: its model folder and a digest of its template and pattern."""
    digest = hashlib.blake2b(f"{template}\0{pattern}".encode(), digest_size=8).hexdigest()
    return f"{model_dir} (template+pattern {digest})"
