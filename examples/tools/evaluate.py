"""Held-out accuracy of an actor with the calculator: greedy episodes through the pipeline's own episode loop (the
environment of ``--config``, stepped in this process), graded as the training reward grades.

    python examples/tools/evaluate.py MODEL --problems runs/tools/heldout.jsonl [--out answers.jsonl]

``MODEL`` is a model folder (a run's ``final/actor``) or a builtin name. Prints one JSON line: the accuracy, its
counts, and the share of episodes that called the tool. The model on its own (no tool):
``examples/arithmetic/evaluate.py MODEL --problems runs/tools/heldout-plain.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.config import load_config  # noqa: E402
from common.data import load_prompts, tokenize_prompts  # noqa: E402
from common.models import load_tokenizer, resolve_model  # noqa: E402
from common.sampling import Samples, SamplingParams  # noqa: E402
from common.schema import PromptBatch, new_header  # noqa: E402
from recipes.rewards import final_number_matches  # noqa: E402
from services.generator.episodes import EpisodeSampler  # noqa: E402
from services.generator.samplers import make_sampler  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--problems", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=HERE / "grpo.yaml")
    parser.add_argument("--out", type=Path, help="write each problem, label, episode and verdict here (JSONL)")
    parser.add_argument("--summary", type=Path, help="write the accuracy line here too (vLLM logs to stdout)")
    parser.add_argument(
        "--backend", choices=["auto", "vllm", "transformers"], default="auto", help="auto: vLLM if installed"
    )
    parser.add_argument(
        "--one-at-a-time", action="store_true", help="one episode in flight (a turn's latency alone), not all at once"
    )
    args = parser.parse_args()
    config = load_config(
        args.config,
        [
            f"model.actor={args.model}",
            f"data.prompts={args.problems.resolve()}",
            "environment.placement=local",
            f"generation.backend={args.backend}",
        ],
    )
    path = resolve_model(config.model.actor, config.model.cache_dir)
    tokenizer = load_tokenizer(path)
    problems = load_prompts(args.problems)
    tokens, lengths = tokenize_prompts(
        tokenizer, problems.texts, config.data.max_prompt_tokens, chat_template=config.data.chat_template
    )
    rows = len(problems.texts)
    message = PromptBatch(
        **new_header("evaluate", "evaluate", 0, {}),
        step=0,
        prompt_index=np.arange(rows),
        prompt_text=problems.texts,
        prompt_label=problems.labels,
        prompt_tokens=tokens,
        prompt_lengths=lengths,
    )
    episodes = EpisodeSampler(make_sampler(config, path, tokenizer), tokenizer, config, lambda: 0)
    greedy = SamplingParams(n=1, max_new_tokens=config.generation.max_new_tokens, temperature=0.0)
    if args.one_at_a_time:
        samples = Samples.concat([episodes.sample(message, np.array([row]), greedy) for row in range(rows)])
    else:
        samples = episodes.sample(message, np.arange(rows), greedy)
    episodes.close()
    texts = [
        tokenizer.decode(samples.response_tokens[i, : int(samples.response_lengths[i])], skip_special_tokens=True)
        for i in range(rows)
    ]
    right = final_number_matches(problems.texts, texts, problems.labels)
    called = [int(t) > 1 for t in samples.turn_counts()]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w") as out:
            for p, y, a, r, c in zip(problems.texts, problems.labels, texts, right, called):
                out.write(json.dumps({"prompt": p, "label": y, "episode": a, "correct": bool(r), "tool": c}) + "\n")
    summary = {
        "model": str(args.model),
        "accuracy": sum(right) / rows,
        "correct": int(sum(right)),
        "problems": rows,
        "tool_calls": sum(called) / rows,
        # What a turn cost here, all episodes in flight at once: the model's turns, and the environment's answers.
        "model_turn_ms_median": round(1000 * float(np.median(episodes.model_seconds)), 1),
        "environment_turn_ms_median": round(1000 * float(np.median(episodes.environment_seconds or [0.0])), 1),
    }
    line = json.dumps(summary)
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
