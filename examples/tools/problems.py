"""Multi-step arithmetic with large numbers for the tools recipe, from reasoning-gym's ``basic_arithmetic``
generator: a training file, a held-out file that shares no expression with it (both with the tool's instructions,
in the chat template written out, the model's turn begun in a calculator call), and the held-out questions alone,
for the model on its own (``examples/arithmetic/evaluate.py`` applies the chat template).

    python examples/tools/problems.py --out runs/tools   # train, heldout, train-plain, heldout-plain (.jsonl)

Each row's label is the answer; ``recipes.rewards:final_number_matches`` grades the last number of a response.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import reasoning_gym  # noqa: E402

from services.environment.tools import calculate  # noqa: E402

# SmolLM2's chat template written out, with one earlier exchange in which the assistant used the calculator: a 135M
# model shown the tool in the user's text alone never called it (0 of 30 held-out problems).
CHAT = (
    "<|im_start|>system\nYou have a calculator: write <calculator>EXPRESSION</calculator> and the result comes back "
    "as <result>VALUE</result>.<|im_end|>\n"
    "<|im_start|>user\nCalculate 12 * 34 + 5.<|im_end|>\n"
    "<|im_start|>assistant\n<calculator>12 * 34 + 5</calculator>\n<result>\n413\n</result>\nThe answer is 413."
    "<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
)


def problems(seed: int, size: int) -> list[dict]:
    dataset = reasoning_gym.create_dataset(
        "basic_arithmetic",
        seed=seed,
        size=size,
        min_terms=2,
        max_terms=3,
        min_digits=2,
        max_digits=4,
        operators=("+", "-", "*"),
        allow_parentheses=False,
        allow_negation=False,
    )
    # reasoning-gym 0.1.25 without parentheses gives some mixed expressions the value of a bracketing it does not
    # print ("50 + 83 * 6" answered 798, not 548: 12% of such rows): keep the rows whose answer is the expression's.
    return [
        {"question": row["question"], "label": row["answer"]}
        for row in dataset
        if calculate(row["metadata"]["expression"]) == row["answer"]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--heldout", type=int, default=200)
    args = parser.parse_args()
    heldout = problems(args.seed + 1, 2 * args.heldout)[: args.heldout]
    seen = {row["question"] for row in heldout}
    train = [row for row in problems(args.seed, 2 * args.train) if row["question"] not in seen]
    train = train[: args.train]
    args.out.mkdir(parents=True, exist_ok=True)
    files = (
        ("train", train, True),
        ("heldout", heldout, True),
        ("train-plain", train, False),  # the questions alone, for an agent that writes its own messages
        ("heldout-plain", heldout, False),
    )
    for name, rows, tools in files:
        with (args.out / f"{name}.jsonl").open("w") as out:
            for row in rows:
                prompt = CHAT.format(question=row["question"]) if tools else row["question"]
                out.write(json.dumps({"prompt": prompt, "label": row["label"]}) + "\n")
    print(f"{len(train)} training and {len(heldout)} held-out problems in {args.out}")


if __name__ == "__main__":
    main()
