"""Fleets at cluster scale, simulated compute: N on-policy runs served by one generator, one scorer and one advantage
replica (``streamppo fleet``), against the same runs one after another on a fleet of their own, on the same
accelerators.

    python -m benchmarks.cluster.fleets [--profiles 0.5b-balanced ...] [--runs 1 2 4 8] [--steps 6]

The accelerators are one per stage in both set-ups: each run alone has a generator, a scorer, an advantage service
and a learner of its own (today's way: a run owns its replicas); in the shared set-up the fleet's three replicas
serve every run, and the runs' learners take turns at one trainer accelerator (a file lock held while each trains,
as LoRA learners on one GPU would share it). ``--own-learners`` gives each run's learner an accelerator of its own
instead (then the shared set-up has 3 + N accelerators against the separate fleets' 4 N).

Prints one JSON line per measurement: updates/s of all runs together in the window where all of them trained, and
runs of 100 steps finished per hour at the profile's real (unscaled) seconds. The numbers go to
benchmarks/RESULTS-by-hand.md by hand (section 16).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.cluster.bench import EXAMPLE, REPO, SCALE, Cluster, _overrides
from benchmarks.cluster.profiles import PROFILES

RUN_STEPS = 100  # the run length runs/hour is counted for


def _start(cluster: Cluster, name: str, role: str, *args: str) -> None:
    command = [
        sys.executable,
        "-m",
        "benchmarks.cluster.simulated",
        role,
        f"--profile={cluster.profile}",
        f"--scale={cluster.scale}",
        f"--bootstrap={cluster.broker.bootstrap}",
        f"--replica-id={name}",
        *args,
    ]
    log = (cluster.folder / f"{name}.log").open("w")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a stand-in waits; what is left is glue work
    cluster.processes[name] = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)


def _update_times(run_dir: Path) -> list[float]:
    return [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").open()]


def measure(profile_name: str, runs: int, steps: int, shared: bool, own_learners: bool = False) -> dict:
    """``runs`` on-policy runs of ``steps`` updates: on one fleet (``shared``) or, with ``runs`` 1, a run with replicas
    of its own (the services as ``streamppo up`` starts them). Updates/s in the window where every run trained."""
    from common.config import load_config

    profile = PROFILES[profile_name]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        configs = folder / "runs"
        configs.mkdir()
        run_dirs = []
        for i in range(runs):
            run_dir = folder / f"run-{i}"
            overrides = _overrides(profile, run_dir, steps, staleness=0, run_id=f"fleet{i}")
            config = load_config(EXAMPLE, overrides)
            (configs / f"run-{i}.yaml").write_text(config.model_dump_json(indent=2, exclude_unset=True))
            run_dirs.append(run_dir)
        cluster = Cluster(profile_name, [], folder)
        lock = [] if own_learners else [f"--device-lock={folder / 'trainer.lock'}"]
        try:
            if shared:
                for role in ("advantage", "scorer", "generator"):
                    _start(cluster, f"{role}-fleet", role, f"--runs={configs}")
            for i in range(runs):
                config = f"--config={configs / f'run-{i}.yaml'}"
                _start(cluster, f"learner-{i}", "learner", config, *lock)
                if not shared:
                    for role in ("advantage", "scorer", "generator"):
                        _start(cluster, f"{role}-{i}", role, config)
                _start(cluster, f"feeder-{i}", "feeder", config)
            stage_s = sum(profile.stage_seconds().values()) * SCALE
            for i in range(runs):
                cluster.wait(f"learner-{i}", timeout_s=300 + runs * steps * stage_s * 3)
        finally:
            cluster.close()
        times = [_update_times(run_dir) for run_dir in run_dirs]
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    inside = sum(1 for t in times for x in t if start < x <= end)
    per_s = inside / (end - start) if end > start else float("nan")
    accelerators = 4 if not shared else (3 + (runs if own_learners else 1))
    return {
        "profile": profile_name,
        "runs": runs,
        "fleet": "shared" if shared else "own",
        "learners": "own accelerator each" if own_learners or not shared else "one accelerator, taking turns",
        "accelerators": accelerators,
        "steps": steps,
        "window_s": round(end - start, 2),
        "updates_in_window": inside,
        "updates_per_s": round(per_s, 4),
        "runs_per_hour": round(per_s * SCALE * 3600 / RUN_STEPS, 3),  # scaled seconds back to the profile's
        "ideal_updates_per_s": round(ideal(profile_name, runs, shared and not own_learners), 4),
    }


def ideal(profile_name: str, runs: int, shared_trainer: bool) -> float:
    """Updates/s no scheduler beats for ``runs`` on-policy runs: each run's steps pass every stage one after the
    other (1 / their sum each), and a stage on one accelerator does at most 1 / its seconds (the learner's only if
    the runs share it)."""
    stages = {role: s * SCALE for role, s in PROFILES[profile_name].stage_seconds().items()}
    shared = [s for role, s in stages.items() if role != "learner" or shared_trainer]
    return min(runs / sum(stages.values()), 1 / max(shared))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", nargs="+", default=["0.5b-balanced", "0.5b-generation-heavy", "0.5b-h200"])
    parser.add_argument("--runs", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--own-learners", action="store_true", help="an accelerator per run's learner")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on replicas of its own")
    args = parser.parse_args(argv)
    for profile in args.profiles:
        if not args.no_baseline:
            print(json.dumps(measure(profile, 1, args.steps, shared=False)), flush=True)
        for runs in args.runs:
            print(
                json.dumps(measure(profile, runs, args.steps, shared=True, own_learners=args.own_learners)), flush=True
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
