#!/usr/bin/env bash
# benchmarks/gpu.py on a GPU machine that has torch and transformers but no network and none of streamppo's
# other packages (pydantic, blake3). Two steps:
#
#   bash benchmarks/gpu.sh wheels   # on a machine that reaches PyPI: the missing packages into .whl/ (git-ignored)
#   bash benchmarks/gpu.sh run      # on the GPU machine, in the repo root, .whl/ beside it: writes gpu.json, gpu.log
#                                   # into $OUT (or the current folder); stops gpu.py after $GPU_TIMEOUT_S (480) s;
#                                   # further arguments go to gpu.py
#
# Then merge the JSON into RESULTS.md: python -m benchmarks.run --only '' --gpu-results gpu.json
set -euo pipefail

# pyproject's pins, with pydantic's own dependencies at the versions the test environment resolves.
WHEELS=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 blake3==1.0.11)
PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}  # the GPU machine's Python

case "${1:-}" in
  wheels)
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
      platforms+=(--platform "$p")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
      "${platforms[@]}" -d .whl "${WHEELS[@]}"
    ls -l .whl
    ;;
  run)
    shift
    out=${OUT:-.}
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    # Every process of the check is on this machine, which may have no network: gloo (the broadcast, the ranks'
    # control messages) binds to loopback rather than to whatever the hostname resolves to.
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    timeout "${GPU_TIMEOUT_S:-480}" python3 benchmarks/gpu.py --out "$out/gpu.json" "$@" 2>&1 | tee "$out/gpu.log"
    ;;
  *)
    echo "usage: bash benchmarks/gpu.sh wheels|run" >&2
    exit 2
    ;;
esac
