"""Evaluation answers before and after training: ``generations.md`` in the run directory.

The actor answers the first ``data.eval_prompts`` prompts with a fixed seed once before the first update and once
after the last, so the two columns differ only by training.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.config import RunConfig
from common.data import load_prompts, tokenize_prompts
from common.generation import sample_responses
from common.sampling import SamplingParams

__all__ = ["answer_eval_prompts", "render_generations", "write_generations"]


def answer_eval_prompts(actor, tokenizer, config: RunConfig, policy_version: int) -> list[dict]:
    """The actor's answers to the first ``data.eval_prompts`` prompts, sampled with the run's seed."""
    data, gen = config.data, config.generation
    texts = load_prompts(data.prompts).texts[: data.eval_prompts]
    tokens, lengths = tokenize_prompts(tokenizer, texts, data.max_prompt_tokens, data.chat_template)
    params = SamplingParams(
        n=1,
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        seed=config.run.seed,
    )
    samples = sample_responses(
        actor,
        torch.from_numpy(tokens),
        torch.from_numpy(lengths),
        params,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    answers = tokenizer.batch_decode(samples.response_tokens, skip_special_tokens=True)
    return [{"prompt": p, "response": a, "policy_version": policy_version} for p, a in zip(texts, answers)]


def render_generations(before: list[dict], after: list[dict]) -> str:
    """A markdown table: each prompt with its answer before and after training."""

    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|") or "(empty)"

    versions = (before[0]["policy_version"], after[0]["policy_version"]) if before and after else (0, 0)
    lines = [
        f"# Generations before (v{versions[0]}) and after (v{versions[1]}) training",
        "",
        "| prompt | before | after |",
        "|---|---|---|",
    ]
    lines += [f"| {cell(b['prompt'])} | {cell(b['response'])} | {cell(a['response'])} |" for b, a in zip(before, after)]
    return "\n".join(lines) + "\n"


def write_generations(run_dir: Path, before: list[dict], after: list[dict]) -> Path:
    """``generations.md`` and ``generations.jsonl`` (prompt, before, after) in ``run_dir``."""
    path = Path(run_dir) / "generations.md"
    path.write_text(render_generations(before, after))
    (Path(run_dir) / "generations.jsonl").write_text(
        "".join(
            json.dumps({"prompt": b["prompt"], "before": b["response"], "after": a["response"]}) + "\n"
            for b, a in zip(before, after)
        )
    )
    return path
