#!/usr/bin/env bash
# The opinions recipe, end to end on CPU: preference pairs -> reward model -> PPO on SmolLM2 through the real
# pipeline (every service its own process over a local Kafka-protocol broker, vLLM generator when installed) ->
# report. Usage: examples/opinions/run.sh [RUN_DIR] [--set key=value ...]   (needs `pip install -e ".[recipe]"`)
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN="${1:-runs/opinions}"; shift || true
BIN="$(dirname "$(command -v python)")"
[ -x .venv/bin/streamppo ] && BIN=.venv/bin
"$BIN/python" examples/opinions/pairs.py --out "$RUN/pairs.jsonl"
"$BIN/streamppo" models prepare smollm2-135m-instruct
"$BIN/streamppo" train-rm --pairs "$RUN/pairs.jsonl" --out "$RUN/reward-model"
"$BIN/streamppo" up --config examples/opinions/ppo.yaml --set "run.dir=$RUN/ppo" --set "reward.model=$RUN/reward-model" "$@"
"$BIN/streamppo" report "$RUN/ppo"
echo "generations before and after: $RUN/ppo/generations.md"
