"""The gateway, measured: what it adds to a call, what building a prompt costs as an episode grows, calls across
kill -9s, and tokens/s through it against the built-in episode loop.

    python benchmarks/gateway.py tokenize [--turns 128]   # per call: reusing the episode's tokens vs re-tokenising
    python benchmarks/gateway.py latency [--calls 200]    # a call through the gateway over the generator's own time
    python benchmarks/gateway.py kills [--kills 20]       # calls lost or duplicated across random kill -9s
    python benchmarks/gateway.py kills --kills 3 --kill gateway --steps 16 --max-staleness 1 --clients 2 --trials 5
                                                          # the promises issue's run: updates reached of 16, per trial
    python benchmarks/gateway.py throughput               # model tokens/s: agents through the gateway vs episodes

Each prints one JSON line (and the numbers go to benchmarks/RESULTS.md by hand, section 15).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import load_config  # noqa: E402
from common.models import load_tokenizer, resolve_model  # noqa: E402
from common.schema import decode  # noqa: E402
from services.gateway.conversation import CallView, Prompts, render_chat  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "streamppo"


# ------------------------------------------------------------------ tokenize


def tokenize(args) -> dict:
    """An agent's chat of ``--turns`` turns with SmolLM2-135M-Instruct's template (each answer ~30 tokens, each tool
    result ~15): at turns 8, 32 and 128, the time to make the call's prompt as the gateway does (the episode's tokens
    reused, only the new text tokenized) against re-tokenising the whole rendered chat, as a plain server does."""
    tokenizer = load_tokenizer(resolve_model("builtin:smollm2-135m-instruct", CACHE))
    prompts = Prompts(tokenizer)
    rng = random.Random(0)
    words = "the answer is a number we add and then multiply result value sum total of two three".split()
    messages = [{"role": "system", "content": "You have a calculator."}, {"role": "user", "content": "Calculate 1+2."}]
    earlier: list[CallView] = []
    marks, gateway_ms, plain_ms, render_ms = {8, 32, args.turns}, {}, {}, {}
    eos = tokenizer.eos_token_id
    for turn in range(1, args.turns + 1):
        started = time.perf_counter()
        prompt = prompts.chat(messages, earlier)
        made = time.perf_counter() - started
        started = time.perf_counter()
        text = render_chat(tokenizer, messages)
        rendered = time.perf_counter() - started
        started = time.perf_counter()
        plain = tokenizer(text, add_special_tokens=False).input_ids
        plain_s = time.perf_counter() - started + rendered
        if turn in marks:
            gateway_ms[turn], plain_ms[turn], render_ms[turn] = made * 1000, plain_s * 1000, rendered * 1000
            assert turn == 1 or prompt.parent, "the chat goes on from the call before"
            assert len(prompt.tokens) >= len(plain) - 2 * turn  # the same conversation (the model's EOS kept)
        answer = " ".join(rng.choice(words) for _ in range(24))
        response = tuple(tokenizer(answer, add_special_tokens=False).input_ids) + (eos,)
        call = CallView(f"c{turn}", prompt.full_text, prompt.tokens, response, answer, answer,
                        tokenizer.decode([eos]), prompt.row_start, len(messages))  # fmt: skip
        earlier.append(call)
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"<result>{rng.randint(0, 10**9)}</result>"}]  # fmt: skip
    return {
        "turns": sorted(marks),
        "gateway_ms": {t: round(v, 3) for t, v in sorted(gateway_ms.items())},
        "retokenise_ms": {t: round(v, 3) for t, v in sorted(plain_ms.items())},
        "of_which_render_ms": {t: round(v, 3) for t, v in sorted(render_ms.items())},
        "prompt_tokens_at_last": len(earlier[-1].prompt_tokens),
    }


# ------------------------------------------------------------------ a gateway run as processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Run:
    """A gateway run's services as processes over Apache Kafka (a broker of its own, its log in ``folder``), with the
    roles given."""

    def __init__(self, folder: Path, settings: dict, roles: list[str]):
        from services.transport.brokers.apache_kafka import KafkaBroker

        self.folder, self.roles = folder, roles
        folder.mkdir(parents=True, exist_ok=True)
        self.broker = KafkaBroker(folder / "kafka").start()
        self.port = free_port()
        settings = _merge(settings, {
            "run": {"dir": str(folder / "run"), "run_id": f"bench-{folder.name}"},
            "kafka": {"bootstrap": self.broker.bootstrap, "session_timeout_ms": 1000, "heartbeat_interval_ms": 250},
        })  # fmt: skip
        if "gateway" in settings:
            settings = _merge(settings, {"gateway": {"port": str(self.port),
                                                     "episode_timeout_s": 300}})  # fmt: skip
        import yaml

        self.config_path = folder / "run.yaml"
        self.config_path.write_text(yaml.safe_dump(settings))
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.processes: dict[str, subprocess.Popen] = {}
        subprocess.run([sys.executable, "-m", "services.cli", "topics", "--config", str(self.config_path)],
                       cwd=REPO, check=True, capture_output=True)  # fmt: skip
        for role in roles:
            self.start(role)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, role: str) -> None:
        args = [role, "--config", str(self.config_path)] + ([] if role == "feed" else ["--replica-id", f"{role}-0"])
        log = open(self.folder / f"{role}.log", "a")
        self.processes[role] = subprocess.Popen([sys.executable, "-m", "services.cli", "-v", *args], cwd=REPO,
                                                stdout=log, stderr=subprocess.STDOUT, env=self.env)  # fmt: skip

    def kill(self, role: str) -> None:
        self.processes[role].send_signal(signal.SIGKILL)
        self.processes[role].wait()

    def wait_healthy(self, timeout_s=600) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
            if self.processes["gateway"].poll() is not None:
                raise RuntimeError(f"the gateway exited: {self.folder / 'gateway.log'}")
        raise RuntimeError(f"the gateway did not start: {self.folder}")

    def read(self, topic: str) -> list:
        from services.ops.runlog.reader import BusReader
        from services.roles import pipeline_topics
        from services.runtime.run_bus import kafka_bus

        config = load_config(self.config_path)
        bus = kafka_bus(config, make=False)
        try:
            partitions = {s.name: s.partitions for s in pipeline_topics(config.kafka.partitions)}
            return [decode(r.value) for r in BusReader(bus=bus, partitions=partitions).records(topic)]
        finally:
            bus.close()

    def waiting(self) -> list[str]:
        """What each replica that holds input says it waits for (`streamppo status`)."""
        from services.ops.status import read_status
        from services.runtime.run_bus import kafka_bus

        config = load_config(self.config_path)
        bus = kafka_bus(config, make=False)
        try:
            replicas = read_status(bus, config.run.run_id).replicas.values()
        finally:
            bus.close()
        return [f"{r.replica}: {r.waiting_for}" for r in replicas if r.waiting_for]

    def close(self) -> None:
        from services.launch.cluster import stop_all

        stop_all(list(self.processes.values()), timeout_s=30)
        self.broker.stop()


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _smollm(folder: Path, steps: int = 100, vllm: bool = True) -> dict:
    return {
        "run": {"steps": steps},
        "model": {"actor": "builtin:smollm2-135m-instruct"},
        "data": {"prompts": str(folder / "train-plain.jsonl"), "batch_size": 8, "eval_prompts": 0},
        "generation": {"n": 4, "max_new_tokens": 32, "temperature": 0.7, "streaming": True,
                       **({"backend": "vllm", "vllm": {"kv_cache_gib": 1.0}} if vllm else {"backend": "transformers"})},
        "reward": {"function": "recipes.rewards:no_score"},
        "algorithm": {"estimator": "grpo", "kl_in": "loss", "kl_estimator": "k3", "kl_coef": 0.02},
        "learner": {"ppo_epochs": 1, "mini_batch_size": 16, "actor_lr": 1.0e-5},
        "gateway": {"max_calls": 1000, "max_episode_tokens": 100_000},
    }  # fmt: skip


def _problems(folder: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "examples/tools/problems.py"), "--out", str(folder)], check=True,
                   capture_output=True)  # fmt: skip


# ------------------------------------------------------------------ latency


def latency(args) -> dict:
    """Calls through the gateway (an `openai` client, one call in flight at a time, each a fresh short chat) against
    the generator's own time for each (from taking the request to its last token, in the call's log event): what
    the gateway adds (HTTP, the bus both ways, the log write), median and p99. Only the feeder, the gateway and the
    generator (vLLM, SmolLM2-135M) run: no training beside it."""
    import httpx
    from openai import OpenAI

    folder = Path(args.dir) / "latency"
    _problems(folder)
    run = Run(folder, _smollm(folder), ["generator", "gateway", "feed"])
    try:
        run.wait_healthy()
        task = httpx.post(f"{run.url}/episodes/claim", json={"wait_s": 60}, timeout=120).json()
        client = OpenAI(base_url=task["base_url"], api_key=task["api_key"])
        seconds = {}
        for i in range(args.calls + 10):  # the first 10 warm up
            messages = [{"role": "user", "content": f"Calculate {i} + {i * 7}."}]
            started = time.perf_counter()
            answer = client.chat.completions.create(model=task["model"], messages=messages, max_tokens=16)
            if i >= 10:
                seconds[answer.id.removeprefix("call-")] = time.perf_counter() - started
        events = {e.event: e for e in run.read("episodes") if e.kind == "call"}
    finally:
        run.close()
    total = np.array([seconds[c] for c in seconds]) * 1000
    sampled = np.array([float(events[c].lineage["generator.seconds"]) for c in seconds]) * 1000
    added = total - sampled
    return {
        "calls": len(total),
        "call_ms": {"median": round(float(np.median(total)), 1), "p99": round(float(np.percentile(total, 99)), 1)},
        "generator_ms": {
            "median": round(float(np.median(sampled)), 1),
            "p99": round(float(np.percentile(sampled, 99)), 1),
        },
        "added_ms": {"median": round(float(np.median(added)), 1), "p99": round(float(np.percentile(added, 99)), 1)},
        "added_share_median": round(float(np.median(added / total)), 3),
    }


# ------------------------------------------------------------------ kills


def kills(args) -> dict:
    """``--trials`` runs of :func:`kill_trial`; each trial's counts, and the updates reached in each."""
    trials = [kill_trial(args, Path(args.dir) / f"kills-{trial}", args.seed + trial) for trial in range(args.trials)]
    if len(trials) == 1:
        return trials[0]
    finished = sum(t["updates"] == args.steps for t in trials)
    return {"trials": trials, "finished": f"{finished} of {len(trials)} reached {args.steps} updates"}


def kill_trial(args, folder: Path, seed: int) -> dict:
    """A gateway run (tiny chat model, transformers sampler: the kills are what is measured) with ``--clients``
    `streamppo agents` processes of 8 agents each, a 4-call loop per agent, and ``--kills`` kill -9s at random times
    of a role of ``--kill`` (the gateway or the generator), each started again after a second. Whether the run reached
    its updates within 15 minutes of the last kill; every answer a client got looked up on the episodes log: lost (not
    there), duplicated (there twice, or an episode trained twice); calls on the log that no client got (its answer
    was cut off and the retry was answered from the log instead: counted, not duplicates)."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    log = folder / "agents.jsonl"
    folder.mkdir(parents=True)
    settings = {
        "run": {"steps": args.steps},
        "pipeline": {"max_staleness": args.max_staleness},
        "model": {"actor": "builtin:tiny-chat-llama"},
        "data": {"prompts": str(REPO / "examples/vowels/prompts.jsonl"), "batch_size": 2, "eval_prompts": 0},
        "generation": {"n": 2, "max_new_tokens": 24, "streaming": True, "backend": "transformers"},
        "reward": {"function": "recipes.rewards:no_score"},
        "algorithm": {"estimator": "grpo", "kl_in": "loss", "kl_estimator": "k3"},
        "learner": {"mini_batch_size": 4, "checkpoint_every": 2, "groups_per_update": args.groups_per_update},
        "gateway": {"episode_timeout_s": 96},  # the promises issue's run
    }
    run = Run(folder, settings, ["learner", "advantage", "scorer", "generator", "gateway", "feed"])
    run.env["AGENT_LOG"] = str(log)
    agents = [sys.executable, "-m", "services.cli", "agents", "--config", str(run.config_path), "--function",
              f"{REPO}/tests/agents/chat.py:calls_logged", "--workers", "8"]  # fmt: skip
    clients = [
        subprocess.Popen(
            agents, cwd=REPO, env=run.env, stdout=open(folder / f"agents-{i}.log", "w"), stderr=subprocess.STDOUT
        )
        for i in range(args.clients)
    ]
    rng = random.Random(seed)
    metrics = folder / "run" / "metrics.jsonl"

    def updated() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    killed, started = [], time.monotonic()
    try:
        run.wait_healthy()
        # The kills spread over the run: after a random 1 to 4 updates each.
        while len(killed) < args.kills and updated() < args.steps:
            target = updated() + rng.randint(1, 4)
            while updated() < min(target, args.steps - 1):
                time.sleep(0.2)
            time.sleep(rng.uniform(0.0, 3.0))  # somewhere inside the update, calls in flight
            role = rng.choice(args.kill)
            run.kill(role)
            killed.append(role)
            time.sleep(1.0)
            run.start(role)
        deadline = time.monotonic() + 900
        while updated() < args.steps and time.monotonic() < deadline:
            time.sleep(1)
        stalled_on = run.waiting() if updated() < args.steps else []
        for client in clients:
            client.send_signal(signal.SIGTERM)
            client.wait(timeout=60)
        events = run.read("episodes")
        updates = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    finally:
        for client in clients:
            client.kill()
        run.close()
    received = [call for line in log.read_text().splitlines() for call in json.loads(line)["calls"]]
    logged = [e.event for e in events if e.kind == "call"]
    groups = [g for line in updates for g in line["groups"]]
    return {
        "kills": len(killed),
        "killed": {role: killed.count(role) for role in sorted(set(killed))},
        "updates": len(updates),
        "seconds": round(time.monotonic() - started),
        "stalled_on": stalled_on,
        "calls_answered": len(received),
        "lost": len(set(received) - set(logged)),
        "duplicated_on_log": len(logged) - len(set(logged)),
        "answered_twice": len(received) - len(set(received)),
        "groups_trained_twice": len(groups) - len(set(groups)),
        "logged_not_answered": len(set(logged) - set(received)),
        "dropped_stale": updates[-1]["dropped_stale"] if updates else 0,
    }


# ------------------------------------------------------------------ throughput


def throughput(args) -> dict:
    """Model tokens per second on the same task and model, sampling alone (no learner: ``--steps`` updates' worth of
    prompt batches, the staleness bound wide enough for all of them): agents (examples/agent/agent.py, ``--workers``
    at once) through the gateway, against the built-in episode loop (examples/tools: the calculator as an environment
    replica, every episode in flight), each as processes over the local broker on vLLM. The tokens the model sampled
    (the rollouts' response masks) over the time from the first prompt batch to the last group's record."""
    out = {}
    folder = Path(args.dir) / "throughput"
    _problems(folder)
    common = _smollm(folder, steps=args.steps)
    common["pipeline"] = {"max_staleness": args.steps}
    tools = {k: v for k, v in common.items() if k != "gateway"}
    tools["data"] = {"prompts": str(folder / "train.jsonl"), "batch_size": 8, "eval_prompts": 0,
                     "chat_template": False, "max_prompt_tokens": 160}  # fmt: skip
    tools["environment"] = {"tools": ["calculator"], "max_turns": 3}
    agent = _merge(common, {"gateway": {"agent": {"function": str(REPO / "examples/agent/agent.py:solve"),
                                                  "workers": args.workers}}})  # fmt: skip
    groups = args.steps * 8
    for name, settings, roles in (
        ("gateway", agent, ["generator", "gateway", "feed"]),
        ("episodes", tools, ["generator", "environment", "feed"]),
    ):
        run = Run(folder / name, settings, roles)
        try:
            deadline = time.monotonic() + 3600
            while True:
                records = run.read("rollouts")
                if sum(len(r.groups()) for r in records) >= groups:
                    break
                assert time.monotonic() < deadline and all(p.poll() in (None, 0) for p in run.processes.values()), name
                time.sleep(5)
            prompts = run.read("prompts")
        finally:
            run.close()
        tokens = sum(int(r.response_mask.sum()) for r in records)
        seconds = max(r.created_at for r in records) - min(p.created_at for p in prompts)
        turns = [int(t) for r in records for t in r.turns]
        out[name] = {
            "episodes": len(turns),
            "model_tokens": tokens,
            "seconds": round(seconds, 1),
            "model_tokens_per_s": round(tokens / seconds, 1),
            "turns_mean": round(sum(turns) / len(turns), 2),
        }
    out["ratio"] = round(out["gateway"]["model_tokens_per_s"] / out["episodes"]["model_tokens_per_s"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["tokenize", "latency", "kills", "throughput"])
    parser.add_argument("--turns", type=int, default=128)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=4, help="kills: updates of the run; throughput: updates' worth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill", nargs="+", default=["gateway", "generator"], help="kills: the roles killed")
    parser.add_argument("--clients", type=int, default=1, help="kills: `streamppo agents` processes")
    parser.add_argument("--max-staleness", type=int, default=1, help="kills: pipeline.max_staleness")
    parser.add_argument(
        "--groups-per-update",
        type=int,
        default=2,
        help="kills: learner.groups_per_update (3: updates end inside a prompt batch of 2, as after a group dropped)",
    )
    parser.add_argument("--trials", type=int, default=1, help="kills: runs, each with seed + its number")
    parser.add_argument("--workers", type=int, default=128, help="throughput: agents at once (128: every episode)")
    parser.add_argument("--dir", default=str(REPO / "runs" / "bench-gateway"))
    args = parser.parse_args()
    print(json.dumps({"benchmark": args.what, **globals()[args.what](args)}))


if __name__ == "__main__":
    main()
