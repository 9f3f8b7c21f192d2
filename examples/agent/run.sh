#!/usr/bin/env bash
# The agent recipe, end to end on CPU: problems (the tools recipe's, the questions alone) -> held-out accuracy of the
# agent (examples/agent/agent.py, the `openai` package) with the base model, served by vLLM's OpenAI server -> GRPO
# through the gateway, the agent running each episode -> the agent's held-out accuracy with the trained model.
# Usage: examples/agent/run.sh [RUN_DIR | --run-dir DIR] [--quick] [--set key=value ...]   (RUN_DIR: runs/agent;
# --quick: every step with small counts, minutes; needs `make venv EXTRAS=recipe`)
set -euo pipefail
source "$(dirname "$0")/../recipe.sh"
recipe_args agent "$@"
"$BIN/python" examples/tools/problems.py --out "$RUN" ${PROBLEMS[@]+"${PROBLEMS[@]}"}
"$BIN/streamppo" models prepare smollm2-135m-instruct
evaluate() {  # MODEL NAME
  "$BIN/python" examples/agent/evaluate.py "$1" --problems "$RUN/heldout-plain.jsonl" \
    --out "$RUN/eval/$2.jsonl" --summary "$RUN/eval/$2.json" > /dev/null
  cat "$RUN/eval/$2.json"
}
evaluate builtin:smollm2-135m-instruct base
started=$SECONDS
"$BIN/streamppo" run --config examples/agent/grpo.yaml --set "run.dir=$RUN/grpo" \
  --set "data.prompts=$RUN/train-plain.jsonl" ${SETS[@]+"${SETS[@]}"}
echo $((SECONDS - started)) > "$RUN/grpo.seconds"
evaluate "$RUN/grpo/final/actor" grpo
quick_tidy "$RUN/grpo"
"$BIN/streamppo" report "$RUN/grpo"
