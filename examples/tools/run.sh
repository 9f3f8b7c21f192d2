#!/usr/bin/env bash
# The tools recipe, end to end on CPU: problems (train + held-out, reasoning-gym) -> held-out accuracy of the base
# model on its own and with the calculator -> GRPO with the calculator (episodes; environment replicas on the bus,
# all in one process) -> held-out accuracy of the trained actor with the calculator, and on its own -> its report.
# Usage: examples/tools/run.sh [RUN_DIR | --run-dir DIR] [--quick] [--set key=value ...]   (RUN_DIR: runs/tools;
# --quick: every step with small counts, minutes; needs `make venv EXTRAS=recipe`; vLLM is used for sampling and
# the evaluations when installed)
set -euo pipefail
source "$(dirname "$0")/../recipe.sh"
recipe_args tools "$@"
"$BIN/python" examples/tools/problems.py --out "$RUN" ${PROBLEMS[@]+"${PROBLEMS[@]}"}
"$BIN/streamppo" models prepare smollm2-135m-instruct
plain() {  # MODEL NAME: the model on its own, the questions alone
  "$BIN/python" examples/arithmetic/evaluate.py "$1" --problems "$RUN/heldout-plain.jsonl" \
    --out "$RUN/eval/$2-plain.jsonl" --summary "$RUN/eval/$2-plain.json" ${EVAL[@]+"${EVAL[@]}"} > /dev/null
  cat "$RUN/eval/$2-plain.json"
}
tools() {  # MODEL NAME: greedy episodes with the calculator
  "$BIN/python" examples/tools/evaluate.py "$1" --problems "$RUN/heldout.jsonl" \
    --out "$RUN/eval/$2-tools.jsonl" --summary "$RUN/eval/$2-tools.json" ${EVAL[@]+"${EVAL[@]}"} > /dev/null
  cat "$RUN/eval/$2-tools.json"
}
plain builtin:smollm2-135m-instruct base
tools builtin:smollm2-135m-instruct base
started=$SECONDS
"$BIN/streamppo" run --config examples/tools/grpo.yaml --set "run.dir=$RUN/grpo" --set "data.prompts=$RUN/train.jsonl" \
  ${SETS[@]+"${SETS[@]}"}
echo $((SECONDS - started)) > "$RUN/grpo.seconds"
tools "$RUN/grpo/final/actor" grpo
plain "$RUN/grpo/final/actor" grpo
quick_tidy "$RUN/grpo"
"$BIN/streamppo" report "$RUN/grpo"
