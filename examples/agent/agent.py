"""An agent as its authors would write it, for any OpenAI-compatible server: the `openai` package, a calculator it
calls itself, a loop it owns. Nothing in it knows of streamppo but ``solve``'s argument (the episode's base URL, key,
model and task), and ``examples/agent/evaluate.py`` runs the same ``converse`` against vLLM's own OpenAI server.

The protocol is text: the model writes ``<calculator>EXPRESSION</calculator>`` (its turn stops at the closing tag,
which the agent puts back when it answers), reads ``<result>VALUE</result>`` as the next user message, and answers.
The reward is 1 when the last number of its final answer is the problem's answer.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.environment.tools import calculate  # noqa: E402  (a safe calculator; any would do)

SYSTEM = (
    "You have a calculator: write <calculator>EXPRESSION</calculator> and the result comes back as "
    "<result>VALUE</result>."
)
# One earlier exchange in which the assistant used the calculator: told of the tool in words alone, a 135M model
# never calls it (the tools recipe found the same).
EXAMPLE = [
    {"role": "user", "content": "Calculate 12 * 34 + 5."},
    {"role": "assistant", "content": "<calculator>12 * 34 + 5</calculator>"},
    {"role": "user", "content": "<result>413</result>"},
    {"role": "assistant", "content": "The answer is 413."},
]
OPEN, CLOSE = "<calculator>", "</calculator>"
MAX_TURNS, MAX_TOKENS = 3, 32


def converse(client: OpenAI, model: str, question: str, **sampling) -> tuple[str, int]:
    """The agent's loop on one problem: its final answer, and the calculator calls it made."""
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]
    calls, text = 0, ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, stop=[CLOSE], **sampling
        )
        text = reply.choices[0].message.content or ""
        if OPEN not in text or reply.choices[0].finish_reason != "stop":
            return text, calls  # an answer (or a call cut off by the token limit: no result)
        calls += 1
        expression = text.rsplit(OPEN, 1)[1]
        try:
            result = calculate(expression)
        except ValueError as exc:
            result = f"error: {exc}"
        messages += [
            {"role": "assistant", "content": text + CLOSE},  # as the model wrote it: the stop string put back
            {"role": "user", "content": f"<result>{result}</result>"},
        ]
    return text, calls


def right(answer: str, label: str) -> bool:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer.replace(",", ""))
    return bool(numbers) and float(numbers[-1]) == float(label)


def solve(episode) -> float:
    """streamppo's entry: one episode of the training run (gateway.agent.function)."""
    client = OpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=10)
    answer, _ = converse(client, episode.model, episode.prompt)
    return 1.0 if right(answer, episode.label) else 0.0
