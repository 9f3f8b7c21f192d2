#!/usr/bin/env bash
# Build streamppo's images with Docker's classic builder, on a base that base-image.sh gives (or makes).
#
#   deploy/docker/build.sh                  streamppo:cpu, streamppo-kafka:local, streamppo-broker:local and
#                                           streamppo-prometheus:local
#   deploy/docker/build.sh cpu broker       only those targets
#
# The images install their Python packages as a user's machine does (deploy/install.py, on the host network). One line
# per image: its build time and size.
set -euo pipefail
cd "$(dirname "$0")/../.."

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(cpu kafka broker prometheus)
declare -A TAGS=([cpu]=streamppo:cpu [gpu]=streamppo:gpu [kafka]=streamppo-kafka:local [broker]=streamppo-broker:local
                 [prometheus]=streamppo-prometheus:local)

if ! docker info >/dev/null 2>&1; then
  echo "build: no Docker engine answers (deploy/docker/engine.sh start): no image built" >&2
  exit 0
fi
base=$(deploy/docker/base-image.sh)
args=(--network host --build-arg "PYTHON_IMAGE=$base")

for target in "${targets[@]}"; do
  tag=${TAGS[$target]:?unknown target $target (cpu, gpu, kafka, broker, prometheus)}
  started=$(date +%s.%N)
  log="${TMPDIR:-/tmp}/streamppo-build-$target.log"
  if ! DOCKER_BUILDKIT=0 docker build "${args[@]}" -f deploy/docker/Dockerfile --target "$target" -t "$tag" . >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "build: $tag failed (the whole log: $log)" >&2
    exit 1
  fi
  seconds=$(python3 -c "print(f'{$(date +%s.%N) - $started:.0f}')")
  size=$(docker image inspect -f '{{.Size}}' "$tag" | python3 -c 'import sys; print(f"{int(sys.stdin.read()) / 1e6:.0f} MB")')
  echo "built $tag in $seconds s ($size, on $base)"
done
