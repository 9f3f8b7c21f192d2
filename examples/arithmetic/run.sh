#!/usr/bin/env bash
# The arithmetic recipe, end to end on CPU: problems (train + held-out) -> held-out accuracy of the base model ->
# PPO with a critic and GRPO without one, the same budget, each through the pipeline in one process -> held-out
# accuracy of each trained actor -> reward curves side by side.
# Usage: examples/arithmetic/run.sh [RUN_DIR] [--set key=value ...]   (needs `pip install -e ".[recipe]"`; vLLM
# is used for sampling and the evaluation when installed)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN="${1:-runs/arithmetic}"; shift || true
BIN="$(dirname "$(command -v python)")"
[ -x .venv/bin/streamppo ] && BIN=.venv/bin
"$BIN/python" examples/arithmetic/problems.py --out "$RUN"
"$BIN/streamppo" models prepare smollm2-135m-instruct
evaluate() {
  "$BIN/python" examples/arithmetic/evaluate.py "$1" --problems "$RUN/heldout.jsonl" \
    --out "$RUN/eval/$2.jsonl" --summary "$RUN/eval/$2.json" > /dev/null
  cat "$RUN/eval/$2.json"
}
evaluate builtin:smollm2-135m-instruct base
for algo in ppo grpo; do
  started=$SECONDS
  "$BIN/streamppo" run --config "examples/arithmetic/$algo.yaml" --set "run.dir=$RUN/$algo" \
    --set "data.prompts=$RUN/train.jsonl" "$@"
  echo $((SECONDS - started)) > "$RUN/$algo.seconds"   # the run's wall time, for compare.py
  evaluate "$RUN/$algo/final/actor" "$algo"
done
"$BIN/python" examples/arithmetic/compare.py "$RUN"
