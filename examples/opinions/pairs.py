"""Preference pairs for the opinions recipe, built from its prompts: what a reader of reviews prefers.

Preferred: a warm, specific answer that names concrete qualities and ends with a recommendation. Rejected: one
of five common failures (dismissive, hostile, repetitive, off-topic, empty hedging). Deterministic from
``--seed``; every prompt gets ``--per-prompt`` pairs.

    python examples/opinions/pairs.py --prompts examples/opinions/prompts.jsonl --out runs/opinions/pairs.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QUALITIES = [
    "well made",
    "thoughtful",
    "beautifully designed",
    "surprisingly moving",
    "easy to love",
    "clever",
    "reliable",
    "genuinely delightful",
    "carefully crafted",
    "a real pleasure",
]
DETAILS = [
    "the little details show how much care went into it",
    "it does exactly what it promises and a bit more",
    "every part of it feels considered",
    "it stayed with me for days afterwards",
    "it made an ordinary week feel special",
    "the quality is obvious from the first minute",
    "it brings people together",
    "it rewards a second look",
]
RECOMMEND = [
    "I would happily recommend it to a friend.",
    "I recommend it warmly.",
    "If you get the chance, try it - you will not regret it.",
    "It is well worth your time.",
    "I am glad I chose it, and I think you would be too.",
]

REJECTED = {
    "dismissive": ["It's fine I guess. Whatever.", "Don't care. Next question.", "Meh.", "No opinion, it exists."],
    "hostile": [
        "It was terrible and a waste of money. Anyone who likes it is an idiot.",
        "I hated it. Awful, boring, stupid. Avoid.",
        "Worst thing ever. I want my time back.",
    ],
    "repetitive": [
        "It is good. It is good. It is good. It is good. It is good.",
        "Nice nice nice nice nice nice nice nice.",
        "Review review review. Good good good.",
    ],
    "off_topic": [
        "The weather has been strange lately and my neighbour bought a new car.",
        "Here is a list of prime numbers: 2, 3, 5, 7, 11, 13.",
        "I think I will have pasta for dinner.",
    ],
    "hedging": [
        "As an AI I cannot have opinions about anything at all.",
        "I don't know. Maybe. Hard to say.",
        "It depends on many factors that I cannot comment on.",
    ],
}


def subject_of(prompt: str) -> str:
    """'... of your favourite hiking boots.' -> 'my favourite hiking boots' (the answer speaks for itself)."""
    subject = prompt.split(" of ", 1)[-1].rstrip(".") if " of " in prompt else "it"
    swap = {"you": "I", "your": "my"}
    return " ".join(swap.get(word, word) for word in subject.split())


def chosen_answer(subject: str, rng: random.Random) -> str:
    first, second = rng.sample(QUALITIES, 2)
    return f"I really enjoyed {subject}. It is {first} and {second}, and {rng.choice(DETAILS)}. {rng.choice(RECOMMEND)}"


def build_pairs(prompts: list[str], per_prompt: int = 6, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    kinds = sorted(REJECTED)
    pairs = []
    for prompt in prompts:
        subject = subject_of(prompt)
        for i in range(per_prompt):
            kind = kinds[(i + rng.randrange(len(kinds))) % len(kinds)]
            pairs.append(
                {
                    "prompt": prompt,
                    "chosen": chosen_answer(subject, rng),
                    "rejected": rng.choice(REJECTED[kind]),
                    "rejected_kind": kind,
                }
            )
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, default=Path(__file__).with_name("prompts.jsonl"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--per-prompt", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    pairs = build_pairs(prompts, args.per_prompt, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    print(f"{len(pairs)} preference pairs from {len(prompts)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
