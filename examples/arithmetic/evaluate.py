"""Held-out accuracy of an actor on the arithmetic problems: greedy answers, graded as the training reward grades.

    python examples/arithmetic/evaluate.py MODEL --problems runs/arithmetic/heldout.jsonl [--out answers.jsonl]

``MODEL`` is a model folder (a run's ``final/actor``) or a builtin name (``builtin:smollm2-135m-instruct``). The
prompts go through the chat template, as in training; answers are greedy, up to ``--max-new-tokens``. Prints one
JSON line: the accuracy and its counts. Uses vLLM when it is installed, transformers otherwise (``--backend``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.config import ModelSection  # noqa: E402
from common.data import load_prompts, tokenize_prompts  # noqa: E402
from common.models import load_tokenizer, resolve_model  # noqa: E402
from recipes.rewards import final_number_matches  # noqa: E402


def greedy_answers(
    model_dir: Path, tokenizer, texts: list[str], max_new_tokens: int, backend: str = "auto"
) -> list[str]:
    tokens, lengths = tokenize_prompts(tokenizer, texts, max_tokens=256, chat_template=True)
    rows = [row[:length].tolist() for row, length in zip(tokens, lengths)]
    if backend == "vllm" or (backend == "auto" and importlib.util.find_spec("vllm") is not None):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=str(model_dir), dtype="float32", seed=0, kv_cache_memory_bytes=2**30, max_model_len=512)
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in rows],
            SamplingParams(temperature=0.0, max_tokens=max_new_tokens),
            use_tqdm=False,
        )
        return [output.outputs[0].text for output in outputs]
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers = []
    for ids in rows:  # one at a time: no padding to get wrong
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--problems", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, help="write each problem, label, answer and verdict here (JSONL)")
    parser.add_argument("--summary", type=Path, help="write the accuracy line here too (vLLM logs to stdout)")
    parser.add_argument(
        "--backend", choices=["auto", "vllm", "transformers"], default="auto", help="auto: vLLM if installed"
    )
    args = parser.parse_args()
    model_dir = resolve_model(args.model, ModelSection.model_fields["cache_dir"].default)
    tokenizer = load_tokenizer(model_dir)
    problems = load_prompts(args.problems)
    answers = greedy_answers(model_dir, tokenizer, problems.texts, args.max_new_tokens, args.backend)
    right = final_number_matches(problems.texts, answers, problems.labels)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            "".join(
                json.dumps({"prompt": p, "label": y, "answer": a, "correct": bool(r)}) + "\n"
                for p, y, a, r in zip(problems.texts, problems.labels, answers, right)
            )
        )
    summary = {"model": str(args.model), "accuracy": sum(right) / len(right), "correct": int(sum(right))}
    line = json.dumps(summary | {"problems": len(right)})
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
