#!/usr/bin/env bash
# The opinions recipe, end to end on CPU: preference pairs -> reward model -> PPO on SmolLM2 through the real
# pipeline (every service its own process over a local Kafka-protocol broker, vLLM generator when installed) ->
# report.
# Usage: examples/opinions/run.sh [RUN_DIR | --run-dir DIR] [--quick] [--set key=value ...]   (RUN_DIR:
# runs/opinions; --quick: every step with small counts, minutes; needs `make venv EXTRAS=recipe`)
set -euo pipefail
source "$(dirname "$0")/../recipe.sh"
recipe_args opinions "$@"
if [ "$QUICK" = 1 ]; then PAIRS=(--per-prompt 2); RM=(--epochs 1); else PAIRS=(); RM=(); fi
"$BIN/python" examples/opinions/pairs.py --out "$RUN/pairs.jsonl" ${PAIRS[@]+"${PAIRS[@]}"}
"$BIN/streamppo" models prepare smollm2-135m-instruct
"$BIN/streamppo" train-rm --pairs "$RUN/pairs.jsonl" --out "$RUN/reward-model" ${RM[@]+"${RM[@]}"}
"$BIN/streamppo" up --config examples/opinions/ppo.yaml --set "run.dir=$RUN/ppo" --set "reward.model=$RUN/reward-model" \
  ${SETS[@]+"${SETS[@]}"}
"$BIN/streamppo" report "$RUN/ppo"
quick_tidy "$RUN/ppo"
echo "generations before and after: $RUN/ppo/generations.md"
