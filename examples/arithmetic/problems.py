"""Arithmetic word problems for the arithmetic recipe: a training file and a held-out file that share no problem.

Each problem adds or subtracts two numbers from 1 to ``--max-number`` in a one-sentence story ("Mia has 13 pens and
gives away 7. How many pens does Mia have left?"); its label is the answer, as text. A problem is its operation and
its two numbers: the held-out split draws its problems first and the training split never uses one of them, whatever
the names and objects around it. Deterministic from ``--seed``.

    python examples/arithmetic/problems.py --out runs/arithmetic     # train.jsonl, heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Tom", "Anna", "Sam", "Mia", "Leo", "Eva", "Noah", "Lily", "Omar", "Zoe"]
OBJECTS = ["apples", "books", "coins", "pens", "cards", "shells", "stickers", "marbles"]
STORIES = {
    "+": [
        "{name} has {a} {obj} and gets {b} more. How many {obj} does {name} have now?",
        "{name} found {a} {obj} in the morning and {b} {obj} in the afternoon. How many {obj} did {name} find?",
        "There are {a} {obj} in a box. {name} puts in {b} more. How many {obj} are in the box?",
    ],
    "-": [
        "{name} has {a} {obj} and gives away {b}. How many {obj} does {name} have left?",
        "There are {a} {obj} on the table. {name} takes {b} of them. How many {obj} are still on the table?",
        "{name} had {a} {obj} and lost {b}. How many {obj} does {name} have now?",
    ],
}


def all_problems(max_number: int) -> list[tuple[str, int, int]]:
    """Every (operation, a, b): sums of two numbers in 1..max_number, and differences that are not negative."""
    numbers = range(1, max_number + 1)
    return [("+", a, b) for a in numbers for b in numbers] + [("-", a, b) for a in numbers for b in numbers if a >= b]


def render(problem: tuple[str, int, int], rng: random.Random) -> dict:
    op, a, b = problem
    story = rng.choice(STORIES[op]).format(name=rng.choice(NAMES), obj=rng.choice(OBJECTS), a=a, b=b)
    return {"prompt": story, "label": str(a + b if op == "+" else a - b)}


def make_splits(seed: int, max_number: int, train: int, heldout: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    problems = all_problems(max_number)
    rng.shuffle(problems)
    if heldout >= len(problems):
        raise SystemExit(f"--heldout {heldout} leaves no problem to train on ({len(problems)} in all)")
    held, rest = problems[:heldout], problems[heldout:]
    return [render(rng.choice(rest), rng) for _ in range(train)], [render(p, rng) for p in held]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for train.jsonl and heldout.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-number", type=int, default=20)
    parser.add_argument("--train", type=int, default=2000, help="training rows (problems repeat in new stories)")
    parser.add_argument("--heldout", type=int, default=200, help="held-out problems, each used once")
    args = parser.parse_args()
    train, heldout = make_splits(args.seed, args.max_number, args.train, args.heldout)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("heldout", heldout)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(train)} training rows, {len(heldout)} held-out problems in {args.out}")


if __name__ == "__main__":
    main()
