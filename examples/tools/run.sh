#!/usr/bin/env bash
# The tools recipe, end to end on CPU: problems (train + held-out, reasoning-gym) -> held-out accuracy of the base
# model on its own and with the calculator -> GRPO with the calculator (episodes; environment replicas on the bus,
# all in one process) -> held-out accuracy of the trained actor with the calculator, and on its own -> its report.
# Usage: examples/tools/run.sh [RUN_DIR] [--set key=value ...]   (needs `pip install -e ".[recipe]"`; vLLM is used
# for sampling and the evaluations when installed)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN="${1:-runs/tools}"; shift || true
BIN="$(dirname "$(command -v python)")"
[ -x .venv/bin/streamppo ] && BIN=.venv/bin
"$BIN/python" examples/tools/problems.py --out "$RUN"
"$BIN/streamppo" models prepare smollm2-135m-instruct
plain() {  # MODEL NAME: the model on its own, the questions alone
  "$BIN/python" examples/arithmetic/evaluate.py "$1" --problems "$RUN/heldout-plain.jsonl" \
    --out "$RUN/eval/$2-plain.jsonl" --summary "$RUN/eval/$2-plain.json" > /dev/null
  cat "$RUN/eval/$2-plain.json"
}
tools() {  # MODEL NAME: greedy episodes with the calculator
  "$BIN/python" examples/tools/evaluate.py "$1" --problems "$RUN/heldout.jsonl" \
    --out "$RUN/eval/$2-tools.jsonl" --summary "$RUN/eval/$2-tools.json" > /dev/null
  cat "$RUN/eval/$2-tools.json"
}
plain builtin:smollm2-135m-instruct base
tools builtin:smollm2-135m-instruct base
started=$SECONDS
"$BIN/streamppo" run --config examples/tools/grpo.yaml --set "run.dir=$RUN/grpo" --set "data.prompts=$RUN/train.jsonl" "$@"
echo $((SECONDS - started)) > "$RUN/grpo.seconds"
tools "$RUN/grpo/final/actor" grpo
plain "$RUN/grpo/final/actor" grpo
"$BIN/streamppo" report "$RUN/grpo"
