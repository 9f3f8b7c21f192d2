"""Held-out accuracy of the agent (examples/agent/agent.py, unchanged) with a model served by vLLM's own
OpenAI-compatible server, greedy: what the agent does with the base model, and with the model trained through the
gateway.

    python examples/agent/evaluate.py MODEL --problems runs/agent/heldout-plain.jsonl [--out answers.jsonl]

``MODEL`` is a model folder (a run's ``final/actor``) or a builtin name. Prints one JSON line: the accuracy, its
counts, and the share of problems on which the agent called its calculator.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.data import load_prompts  # noqa: E402
from common.models import resolve_model  # noqa: E402
from examples.agent.agent import converse, right  # noqa: E402


def serve(model: Path, port: int):
    """vLLM's OpenAI server for ``model`` (CPU or GPU, as installed), once it answers."""
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
         "--served-model-name", "model", "--max-model-len", "2048", "--enforce-eager",
         "--kv-cache-memory-bytes", str(2**30), "--disable-log-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's server for {model} did not start (exit {server.poll()})")
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--problems", type=Path, required=True, help="JSONL: the question (prompt) and its label")
    parser.add_argument("--out", type=Path, help="write each problem, answer and verdict here (JSONL)")
    parser.add_argument("--summary", type=Path, help="write the accuracy line here too")
    parser.add_argument("--port", type=int, default=8612)
    parser.add_argument("--workers", type=int, default=16, help="problems in flight at once")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "streamppo")
    args = parser.parse_args()
    problems = load_prompts(args.problems)
    server = serve(resolve_model(args.model, args.cache_dir), args.port)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=5)
        with ThreadPoolExecutor(args.workers) as pool:
            answers = list(pool.map(lambda q: converse(client, "model", q, temperature=0.0), problems.texts))
    finally:
        server.terminate()
        server.wait(timeout=60)
    verdicts = [right(answer, label) for (answer, _), label in zip(answers, problems.labels)]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w") as out:
            for question, label, (answer, calls), verdict in zip(problems.texts, problems.labels, answers, verdicts):
                row = {"question": question, "label": label, "answer": answer, "calls": calls, "right": verdict}
                out.write(json.dumps(row) + "\n")
    summary = {
        "model": args.model,
        "accuracy": round(sum(verdicts) / len(verdicts), 4),
        "right": sum(verdicts),
        "problems": len(verdicts),
        "called_tool": round(sum(calls > 0 for _, calls in answers) / len(answers), 4),
    }
    line = json.dumps(summary)
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
