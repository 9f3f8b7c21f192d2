"""The images and compose, measured: image sizes, a service container's start-to-ready time, and the wall time of
the vowels run through `docker compose` against `streamppo up` on the same settings, side by side in one run.

Needs a Docker engine and the images (deploy/docker/engine.sh start && deploy/docker/build.sh); the build times are
build.sh's own lines. Every container on the host network.

    python -m benchmarks.containers [--steps 60] [--skip-up]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from services.transport.brokers.local_broker import LocalBroker, free_port

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "deploy" / "compose"
IMAGES = ("streamppo:cpu", "streamppo-broker:local", "streamppo-prometheus:local")


def image_sizes() -> dict[str, float]:
    """MB, as `docker image inspect` counts them."""
    sizes = {}
    for image in IMAGES:
        out = subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", image], capture_output=True, text=True)
        sizes[image] = round(int(out.stdout) / 1e6) if out.returncode == 0 else None
    return sizes


def start_to_ready(trials: int = 3) -> dict:
    """`docker run` of a scorer (streamppo:cpu) against a local broker until its /metrics answers (what the chart's
    readiness probe asks), and until its first status report says it serves (its models loaded, its group joined)."""
    to_metrics, to_serving = [], []
    with LocalBroker() as broker, tempfile.TemporaryDirectory() as shared:
        os.chmod(shared, 0o777)
        for _ in range(trials):
            port, name = free_port(), f"ready-{uuid.uuid4().hex[:6]}"
            started = time.monotonic()
            subprocess.run(
                ["docker", "run", "-d", "--rm", "--name", name, "--network", "host", "-v", f"{shared}:/shared",
                 "streamppo:cpu", "scorer", "--config", "/app/examples/vowels/config.yaml",
                 "--bootstrap", broker.bootstrap, "--metrics-port", str(port), "--metrics-address", "127.0.0.1",
                 "--set", "model.cache_dir=/shared/models", "--set", "kafka.idempotent_producer=false"],
                check=True, capture_output=True,
            )  # fmt: skip
            try:
                while True:
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read()
                        break
                    except OSError:
                        time.sleep(0.05)
                to_metrics.append(time.monotonic() - started)
                while b"status" not in subprocess.run(["docker", "logs", name], capture_output=True).stderr:
                    time.sleep(0.1)
                to_serving.append(time.monotonic() - started)
            finally:
                subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    return {"metrics_answer_s": [round(t, 1) for t in to_metrics], "first_status_s": [round(t, 1) for t in to_serving]}


def compose_run(steps: int, scorers: int = 3) -> dict:
    """`up -d --scale scorer=N` of deploy/compose with the local override, `run --rm wait` to the end, `down -v`."""
    env = dict(os.environ, COMPOSE_PROJECT_NAME=f"bench-{uuid.uuid4().hex[:6]}", STREAMPPO_SET=f"run.steps={steps}")
    env |= {"KAFKA_PORT": str(free_port()), "PROMETHEUS_PORT": str(free_port())}
    command = ["docker", "compose", "-f", "docker-compose.yml", "-f", "docker-compose.local.yml"]
    started = time.monotonic()
    try:
        subprocess.run([*command, "up", "-d", "--scale", f"scorer={scorers}"], cwd=COMPOSE, env=env, check=True,
                       capture_output=True)  # fmt: skip
        waited = subprocess.run([*command, "run", "--rm", "wait"], cwd=COMPOSE, env=env, capture_output=True, text=True)
        wall = time.monotonic() - started
        done = next((line for line in waited.stdout.splitlines() if line.startswith("done:")), waited.stdout[-500:])
    finally:
        subprocess.run([*command, "down", "-v", "-t", "10"], cwd=COMPOSE, env=env, capture_output=True)
    return {"wall_s": round(wall), "exit": waited.returncode, "summary": done}


def up_run(steps: int, scorers: int = 3) -> dict:
    """`streamppo up` of examples/vowels/config.yaml (the settings deploy/compose/run.yaml has) with N scorers."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "services.cli", "up", "--config", str(REPO / "examples/vowels/config.yaml"),
                "--replicas", f"scorer={scorers}", "--set", f"run.steps={steps}", "--set", f"run.dir={tmp}/run",
                "--set", f"run.run_id=bench-{uuid.uuid4().hex[:6]}",
                "--set", f"model.cache_dir={tmp}/models"]  # fmt: skip
        started = time.monotonic()
        result = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
        wall = time.monotonic() - started
        updates = len((Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines())
    return {"wall_s": round(wall), "exit": result.returncode, "updates": updates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip-up", action="store_true")
    args = parser.parse_args()
    results = {"image_mb": image_sizes(), "start_to_ready": start_to_ready()}
    print(json.dumps(results), flush=True)
    results["compose"] = compose_run(args.steps)
    print(json.dumps(results["compose"]), flush=True)
    if not args.skip_up:
        results["up"] = up_run(args.steps)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
