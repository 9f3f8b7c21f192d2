#!/usr/bin/env bash
# Build streamppo's images with Docker's classic builder, on a base that base-image.sh gives (or makes).
#
#   deploy/docker/build.sh                  streamppo:cpu, streamppo-broker:local and streamppo-prometheus:local
#   deploy/docker/build.sh cpu broker       only those targets
#
# Where a folder of PIP_FIND_LINKS (or /opt/wheels) holds torch's CPU wheel, it is served on 127.0.0.1 for the build
# (builds run on the host network) and PyTorch's own index is not asked. One line per image: its build time and size.
set -euo pipefail
cd "$(dirname "$0")/../.."

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(cpu broker prometheus)
declare -A TAGS=([cpu]=streamppo:cpu [gpu]=streamppo:gpu [broker]=streamppo-broker:local [prometheus]=streamppo-prometheus:local)

if ! docker info >/dev/null 2>&1; then
  echo "build: no Docker engine answers (deploy/docker/engine.sh start): no image built" >&2
  exit 0
fi
base=$(deploy/docker/base-image.sh)
args=(--network host --build-arg "PYTHON_IMAGE=$base")

server=""
trap '[ -z "$server" ] || kill "$server" 2>/dev/null' EXIT
for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
  if compgen -G "$dir/torch-2.13.0+cpu-*.whl" >/dev/null; then
    # A fixed port: the address is a build argument, and a new one would make every build miss the layer cache.
    port=${WHEEL_SERVER_PORT:-38471}
    python3 -m http.server "$port" --bind 127.0.0.1 --directory "$dir" >/dev/null 2>&1 &
    server=$!
    for _ in $(seq 50); do python3 -c "import socket; socket.create_connection(('127.0.0.1', $port)).close()" 2>/dev/null && break; sleep 0.1; done
    args+=(--build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/" --build-arg "TORCH_INDEX=")
    echo "build: torch's CPU wheel from $dir" >&2
    break
  fi
done

for target in "${targets[@]}"; do
  tag=${TAGS[$target]:?unknown target $target (cpu, gpu, broker, prometheus)}
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
