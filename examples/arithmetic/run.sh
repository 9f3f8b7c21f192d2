#!/usr/bin/env bash
# The arithmetic recipe, end to end on CPU: problems (train + held-out) -> held-out accuracy of the base model ->
# PPO with a critic, the base model distilled from PPO's actor, GRPO without a critic, and GRPO with dynamic sampling,
# the same number of updates, each through the pipeline in one process -> held-out accuracy of each trained actor ->
# reward curves side by side.
# Usage: examples/arithmetic/run.sh [RUN_DIR | --run-dir DIR] [--quick] [--set key=value ...]   (RUN_DIR:
# runs/arithmetic; --quick: every step with small counts, minutes; needs `make venv EXTRAS=recipe`; vLLM is used
# for sampling and the evaluation when installed)
set -euo pipefail
source "$(dirname "$0")/../recipe.sh"
recipe_args arithmetic "$@"
"$BIN/python" examples/arithmetic/problems.py --out "$RUN" ${PROBLEMS[@]+"${PROBLEMS[@]}"}
"$BIN/streamppo" models prepare smollm2-135m-instruct
evaluate() {
  "$BIN/python" examples/arithmetic/evaluate.py "$1" --problems "$RUN/heldout.jsonl" \
    --out "$RUN/eval/$2.jsonl" --summary "$RUN/eval/$2.json" ${EVAL[@]+"${EVAL[@]}"} > /dev/null
  cat "$RUN/eval/$2.json"
}
evaluate builtin:smollm2-135m-instruct base
train() {  # NAME CONFIG [--set ...]: one run, its wall time and its held-out accuracy
  local name=$1 config=$2; shift 2
  started=$SECONDS
  "$BIN/streamppo" run --config "examples/arithmetic/$config.yaml" --set "run.dir=$RUN/$name" \
    --set "run.run_id=arithmetic-$name" --set "data.prompts=$RUN/train.jsonl" ${SETS[@]+"${SETS[@]}"} "$@"
  echo $((SECONDS - started)) > "$RUN/$name.seconds"   # the run's wall time, for compare.py
  evaluate "$RUN/$name/final/actor" "$name"
  quick_tidy "$RUN/$name"
}
train ppo ppo
# The base model distilled from PPO's actor on its own samples (no task reward): the same number of updates.
train distill distill --set "model.reference=$RUN/ppo/final/actor"
train grpo grpo
# GRPO whose updates take only groups with signal (DAPO's dynamic sampling): same number of updates.
train grpo-dynamic grpo --set algorithm.dynamic_sampling=true
"$BIN/python" examples/arithmetic/compare.py "$RUN"
