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

__all__ = ["answer_eval_prompts", "episode_rows", "render_episodes", "render_generations", "write_generations"]


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


def episode_rows(experience, tokenizer, policy_version: int, count: int) -> list[dict]:
    """The first ``count`` rows an update trained on, as conversations: the prompt, then the response in turns, each
    the model's (the tokens it sampled, ``response_mask``) or the context between (an agent's messages, a tool's
    results, the chat template's markup), with the episode's reward."""
    rows = []
    for i in range(min(count, experience.rows)):
        length = int(experience.response_lengths[i])
        tokens = experience.response_tokens[i, :length].tolist()
        mask = (
            experience.response_mask[i, :length].tolist() if experience.response_mask is not None else [True] * length
        )
        turns, start = [], 0
        for end in range(1, length + 1):
            if end == length or mask[end] != mask[start]:
                turns.append({"model": bool(mask[start]), "text": tokenizer.decode(tokens[start:end])})
                start = end
        prompt = experience.prompt_tokens[i, : int(experience.prompt_lengths[i])].tolist()
        rows.append(
            {
                "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
                "turns": turns,
                "reward": float(experience.scores[i]),
                "policy_version": policy_version,
            }
        )
    return rows


def render_episodes(first: list[dict], last: list[dict]) -> str:
    """Markdown: the conversations of the first update trained and of the last, the model's turns in bold."""

    def conversation(row: dict) -> str:
        said = "".join(f"**{t['text']}**" if t["model"] else t["text"] for t in row["turns"])
        return " ".join(said.split()).replace("|", "\\|") or "(empty)"

    lines = []
    for title, rows in (("the first update", first), ("the last update", last)):
        version = rows[0]["policy_version"] if rows else 0
        lines += [f"## Episodes of {title} (trained into v{version}): the model's turns in bold", "",
                  "| prompt | episode | reward |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {' '.join(r['prompt'].split())} | {conversation(r)} | {r['reward']:.3g} |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def write_generations(
    run_dir: Path, before: list[dict], after: list[dict], episodes: tuple[list[dict], list[dict]] | None = None
) -> Path:
    """``generations.md`` and ``generations.jsonl`` (prompt, before, after) in ``run_dir``; with ``episodes`` (a run
    of multi-turn episodes: its agents' or environment's), the conversations of the first and last updates first."""
    path = Path(run_dir) / "generations.md"
    text = render_generations(before, after) if before and after else ""
    if episodes is not None:
        text = f"# Episodes\n\n{render_episodes(*episodes)}\n" + (f"## Plain answers\n\n{text}" if text else "")
    path.write_text(text)
    (Path(run_dir) / "generations.jsonl").write_text(
        "".join(
            json.dumps({"prompt": b["prompt"], "before": b["response"], "after": a["response"]}) + "\n"
            for b, a in zip(before, after)
        )
    )
    return path
