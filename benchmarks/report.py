"""RESULTS.md from results.json: one table per section, ratios next to what they compare."""

from __future__ import annotations

from pathlib import Path

BY_HAND = Path(__file__).resolve().parent / "RESULTS-by-hand.md"


def _f(x, digits=2) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) >= 1 or x == 0:
            return f"{x:.{digits}f}"
        return f"{x:.2g}"
    return str(x)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_f(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _recovery_notes(rc: dict) -> list[str]:
    """What section 7's figures are spent on, from the trials themselves."""

    def pick(setting, role, replicas, fault="kill -9"):
        wanted = (setting, role, replicas, fault)
        return next((t for t in rc["trials"] if (t["setting"], t["role"], t["replicas"], t["fault"]) == wanted), None)

    def broker(setting, fault):
        return next((t for t in rc.get("brokers", ()) if (t["setting"], t["fault"]) == (setting, fault)), None)

    notes = []
    two, two_before = pick("now", "scorer", 2), pick("before", "scorer", 2)
    if two and two_before:
        notes.append(
            f"One scorer of two killed: {_f(two_before['to_next_update_s'])} s to the next update when the group "
            f"learned of the death from the session timeout (6 s), {_f(two['to_next_update_s'])} s now that `up` "
            "removes the dead member from its group the moment it exits and the other scorer takes its partitions in "
            "one rebalance. One generator of two: the survivor takes the partitions as fast, and must then sample "
            "again the prompt batch the dead one held uncommitted; the pause is not broken down further yet."
        )
    singles = [t for t in (pick("now", r, 1) for r in ("scorer", "generator", "learner")) if t]
    if singles:
        notes.append(
            "A role with one replica: `up` restarts it at once (it waited 1 s before), and the pause is its start "
            "time and what it then does before its first output: "
            + "; ".join(
                f"{t['role']} {_f(t['pause_s'])} s of pause, {_f(t['start_s'])} s from restart to serving"
                for t in singles
            )
            + ". Of a start, importing torch and transformers takes 4.1–5.0 s on this machine (`python -X importtime "
            "-c 'import services.scorer'`); a restarted generator then loads the newest weights and samples its "
            "batch again. A process started ahead of need, with the imports done (a fork server), would take most "
            "of the start off: not built yet."
        )
    stopped = pick("now", "scorer", 2, "SIGSTOP 20 s")
    if stopped:
        notes.append(
            f"A scorer stopped (SIGSTOP) is seen by no supervisor: its session (6 s) bounds the pause, "
            f"{_f(stopped['pause_s'])} s, under both settings."
        )
    pairs = [(broker("before", f), broker("now", f)) for f in ("leader", "controller", "silent leader")]
    if all(b and n for b, n in pairs):
        (lb, ln), (cb, cn), (sb, sn) = pairs
        notes.append(
            f"Three brokers: the leader's kill -9 cost {_f(lb['to_next_update_s'])} s before and "
            f"{_f(ln['to_next_update_s'])} s now, the controller's {_f(cb['to_next_update_s'])} s and "
            f"{_f(cn['to_next_update_s'])} s, a leader that stopped answering (SIGSTOP 20 s, its connections open) "
            f"{_f(sb['to_next_update_s'])} s (the whole stop) and {_f(sn['to_next_update_s'])} s. What a silent "
            "leader costs now: when it is also the active controller, the quorum elects another after 2 s without "
            "its fetches (controller.quorum.fetch.timeout.ms) and that one fences it after 3 s without heartbeats "
            "(broker.session.timeout.ms); until then acks=all writes wait for it as a follower, the clients give "
            "up on it after 5 s (kafka.request_timeout_ms) and find the new leaders within 3 s "
            "(kafka.metadata_max_age_ms). One trial of it alone measured 7.6 s; 3 s requests gave 6.6 s."
        )
    return [line for note in notes for line in (note, "")]


def write_markdown(results: dict, path: Path) -> None:
    s = results["sections"]
    out = [
        "# Benchmark results",
        "",
        f"- written: {results.get('date')}",
        f"- machine: {results.get('machine')}",
        "- command: `python -m benchmarks.run` (all sections; `--only a,b` re-measures some and keeps the rest)",
        "",
        "| section | measured | by |",
        "|---|---|---|",
        *[f"| {name} | {sec.get('measured', '?')} | `{sec.get('command', '?')}` |" for name, sec in s.items()],
        "",
        "Every figure is measured in the same run as what it is compared with. Numbers from a 2-core machine are "
        "about the shape of the costs, not absolute speed.",
        "",
    ]

    if "codec" in s:
        c = s["codec"]
        out += ["## 1. Codec", "", c["batch"], ""]
        out += _table(
            ["codec", "size (MB)", "encode (ms)", "decode (ms)", "size / wire", "encode / wire", "decode / wire"],
            [
                [
                    k,
                    v["bytes"] / 1e6,
                    v["encode_ms"],
                    v["decode_ms"],
                    v["size_vs_wire"],
                    v["encode_vs_wire"],
                    v["decode_vs_wire"],
                ]
                for k, v in c["codecs"].items()
            ],
        )
    if "bus" in s:
        b = s["bus"]
        out += ["## 2. Bus: one topic, in-memory vs Kafka", "", b["broker"], ""]
        out += _table(
            [
                "payload",
                "memory latency (ms)",
                "Kafka latency (ms)",
                "Kafka / memory",
                "memory batches/s",
                "Kafka batches/s",
                "Kafka MB/s",
            ],
            [
                [
                    k,
                    v["memory"]["latency_ms_median"],
                    v["kafka"]["latency_ms_median"],
                    v["kafka_latency_vs_memory"],
                    v["memory"]["batches_per_s"],
                    v["kafka"]["batches_per_s"],
                    v["kafka"]["mb_per_s"],
                ]
                for k, v in b["sizes"].items()
            ],
        )
    if "pipeline" in s:
        p = s["pipeline"]
        out += ["## 3. Pipeline: max_staleness 0 vs 1", "", p["setup"], ""]
        runs = {k: v for k, v in p["runs"].items() if k.startswith("max_staleness")}
        out += _table(
            ["run", "steps/min", "staleness seen"],
            [[k, v["steps_per_min"], v["staleness_seen"]] for k, v in runs.items()],
        )
        out += [
            f"Speed-up of max_staleness 1 over 0: **{_f(p['runs']['speedup_k1_vs_k0'])}×**",
            "",
            "Where each service's time went (shares of its lifetime; *wait* = polling, held for weights, idle):",
            "",
        ]
        rows = []
        for run, v in runs.items():
            for role, st in sorted(v["stages"].items()):
                rows.append(
                    [
                        run,
                        role,
                        st["compute_share"],
                        st["serialise_and_send_share"],
                        st["checkpoint_share"],
                        st["weight_load_share"],
                        st["wait_share"],
                    ]
                )
        out += _table(
            ["run", "service", "model compute", "decode+encode+send+commit", "checkpoint", "weight load", "wait"], rows
        )
        parts = {
            "decode+encode+send+commit": "serialise_and_send_share",
            "checkpoint": "checkpoint_share",
            "weight load": "weight_load_share",
            "wait (transport hops, on-policy dependency, idle)": "wait_share",
        }
        stages = [st for v in runs.values() for st in v["stages"].values()]
        means = {label: sum(st[key] for st in stages) / len(stages) for label, key in parts.items()}
        largest = max(means, key=means.get)
        out += [
            f"Largest cost outside model compute: **{largest}**, {means[largest]:.0%} of a service's time on "
            f"average; serialisation and sending take {means['decode+encode+send+commit']:.1%}.",
            "",
        ]
    if "generation" in s:
        g = s["generation"]
        out += ["## 4. Generation: vLLM vs transformers", ""]
        if "skipped" in g:
            out += [f"Skipped: {g['skipped']}", ""]
        else:
            out += [g["batch"], ""]
            out += _table(
                ["model", "transformers tokens/s", "vLLM tokens/s", "vLLM / transformers"],
                [
                    [k, v["transformers"]["tokens_per_s"], v["vllm"]["tokens_per_s"], v["vllm_vs_transformers"]]
                    for k, v in g["models"].items()
                ],
            )
    if "weights" in s:
        w = s["weights"]
        out += ["## 5. Weight updates: publish and load", "", w["what"], ""]
        stores = [(m, k, v) for m, row in w["models"].items() for k, v in row.items() if "publish_s" in v]
        out += _table(
            ["model", "snapshot, store", "MB", "publish (s)", "load, transformers (s)", "end to end (GB/s)"],
            [
                [m, k, v["snapshot_mb"], v["publish_s"], v["load_transformers_s"], v["end_to_end_gb_per_s"]]
                for m, k, v in stores
            ],
        )
        out += [
            "The old load reads the file into fresh memory and parses it into more: on this VM, whose host backs "
            "guest memory at first touch, that stalls (the same load took 0.97 s in the run of 2026-11-30). The "
            "memory-mapped load touches only the page cache. The store is on tmpfs; on this VM's disk one 538 MB "
            "write takes 0.16 to 6.3 s, whatever writes it. Delta rows: MB is the delta's size, end to end the full "
            "snapshot's bytes over publish + load. On tmpfs a delta is smaller but not faster (diffing and patching "
            "cost more CPU than the bytes saved); it pays where the store's bandwidth is the limit (a network "
            "volume, an object store).",
            "",
            "Broadcast rows (`weights.broadcast`): the receiver is a thread of the benchmark's process, as it is of a "
            "generator's; publish is the learner's send over gloo on loopback, both sides digesting what travels "
            "(the receivers agree on it before the send returns), with the snapshot written to the store at the same "
            "time in the first row; load is the copy from the received buffers at the announcement. On this 2-core "
            "machine the loopback copy and the two digests cost as much as the tmpfs store, and the store is still "
            "written: the broadcast pays where reading the store is slow (a network volume, many generators reading "
            "at once) and between GPUs, where NCCL would carry it (not built: the group is gloo).",
            "",
        ]
        if "changes" in w:
            out += [
                "What changes per PPO update (vowels example, 6 steps, actor snapshots): the share of elements, of "
                "bytes in tensors with any change, and a delta's size (bit mask + changed values) over a full "
                "snapshot:",
                "",
            ]
            out += _table(
                ["actor lr", "snapshot dtype", "elements changed", "bytes in changed tensors", "delta / full"],
                [
                    [
                        c["actor_lr"],
                        c["dtype"],
                        c["elements_changed"],
                        c["bytes_in_changed_tensors"],
                        c["delta_over_full"],
                    ]
                    for c in w["changes"]
                ],
            )
        engines = [(m, v) for m, row in w["models"].items() for k, v in row.items() if "load_vllm_in_place_s" in v]
        if engines:
            out += _table(
                ["model", "vLLM reload before (s)", "vLLM reload now (s)", "engine start (s)", "restart / reload"],
                [
                    [
                        m,
                        v["load_vllm_before_s"],
                        v["load_vllm_in_place_s"],
                        v["vllm_engine_start_s"],
                        v["engine_restart_vs_in_place"],
                    ]
                    for m, v in engines
                ],
            )
    if "adapters" in s:
        a = s["adapters"]
        out += ["## 5b. LoRA adapters against the whole model", "", a["what"], ""]
        out += _table(
            ["snapshot", "MB", "publish (s)", "load, transformers (s)", "publish + load (s)"],
            [
                [k, v["snapshot_mb"], v["publish_s"], v["load_transformers_s"], v["publish_plus_load_s"]]
                for k, v in a["rows"].items()
            ],
        )
        out += [
            f"The adapters are **{_f(a['bytes_ratio'])}×** smaller and go from learner to generator "
            f"**{_f(a['seconds_ratio'])}×** faster.",
            "",
        ]
    if "scaling" in s:
        sc = s["scaling"]
        out += ["## 6. Scorer replicas", "", sc["setup"], ""]
        reps = {k: v for k, v in sc["replicas"].items() if k.endswith("(s)")}
        out += _table(
            ["replicas", "batches", "seconds", "responses/s"],
            [[k, v["batches"], v["seconds"], v["responses_per_s"]] for k, v in reps.items()],
        )
        out += [
            f"Speed-up of 2 replicas over 1: **{_f(sc['replicas']['speedup_2_vs_1'])}×**",
            "",
            "Replicas only help when each gets cores of its own: on a machine with fewer cores than replicas × "
            "torch threads they compete for the same cores, so this ratio is what scaling buys on this machine.",
            "",
        ]
    if "recovery" in s:
        rc = s["recovery"]
        out += ["## 7. Recovery from a killed or stopped replica", "", rc["setup"] + ".", ""]
        if "settings" in rc:
            out += [
                f"- {name}: " + (f"`{' '.join(values)}`" if values else "the defaults (`kafka.*` of the config)")
                for name, values in rc["settings"].items()
            ] + [""]
            out += _table(
                [
                    "fault",
                    "of",
                    "settings",
                    "to next update (s)",
                    "pause (s)",
                    "restart to serving (s)",
                    "dropped stale",
                    "versions once",
                    "groups once",
                ],
                [
                    [
                        f"{t['fault']} {t['role']}-0",
                        t["replicas"],
                        t["setting"],
                        t["to_next_update_s"],
                        t["pause_s"],
                        "—" if t["start_s"] is None else t["start_s"],
                        t["dropped_stale"],
                        t["every_version_once"],
                        t["every_group_once"],
                    ]
                    for t in rc["trials"]
                ],
            )
            out += [
                "To next update: from the fault to the next line of `metrics.jsonl`. Pause: the longest gap between "
                "updates after the fault less the median gap before it. Restart to serving: from `up`'s line that the "
                "replica exited to the restarted replica's `serving` line (interpreter, imports, models, the bus).",
                "",
            ]
            if rc.get("brokers"):
                out += _table(
                    ["three brokers", "settings", "to next update (s)", "pause (s)", "versions once", "groups once"],
                    [
                        [t["fault"], t["setting"], t["to_next_update_s"], t["pause_s"], t["every_version_once"],
                         t["every_group_once"]]
                        for t in rc["brokers"]
                    ],
                )  # fmt: skip
            out += _recovery_notes(rc)
        else:  # results of the benchmark before kafka-python 3 (local broker, consumer sessions compared)
            out += _table(
                ["consumer sessions", "killed", "median gap (s)", "longest gap after (s)", "pause (s)"],
                [
                    [t["sessions"], t["role"], t["median_gap_s"], t["longest_gap_after_kill_s"], t["stall_s"]]
                    for t in rc["trials"]
                ],
            )
        if "broker_loss" in rc:
            bl = rc["broker_loss"]
            out += [
                f"Broker loss: the broker stopped mid-run and `up` with it ({bl['checkpoint_at']} updates "
                f"checkpointed by then); a new empty broker started, `up --resume`: first update after the checkpoint "
                f"**{_f(bl['seconds_to_first_update_after_resume'])} s** after the command; every version applied "
                f"exactly once: {bl['every_version_once']} (exit code {bl['exit_code']}).",
                "",
            ]
    out += ["## 8. GPU", ""]
    if "gpu" in s:
        g = s["gpu"]
        out += [f"{g['setup']} (GPU: {g['device']})", ""]
        out += _table(["measure", "value"], [[k, v] for k, v in g["results"].items()])
        if "fsdp" in g:
            out += ["", f"The FSDP learner over {g['fsdp'].get('ranks', '?')} ranks (one per GPU):", ""]
            out += _table(["measure", "value"], [[k, v] for k, v in g["fsdp"].items() if k != "ranks"])
    else:
        out += [
            "Not measured yet: `benchmarks/gpu.py` is the prepared script (no GPU machine was lent to the session "
            "that wrote this file). Run it on a GPU machine (`benchmarks/gpu.sh run`, with the wheels of "
            "`benchmarks/gpu.sh wheels` where it has no network), then `python -m benchmarks.run --only '' "
            "--gpu-results gpu.json` to merge its JSON here.",
            "",
        ]
    if "cluster" in s:
        out += _cluster(s["cluster"])
    if "streaming" in s:
        out += _streaming(s["streaming"])
    if "in_flight" in s:
        out += _in_flight(s["in_flight"])
    if "engine_memory" in s:
        out += _engine_memory(s["engine_memory"])
    # Sections measured by scripts of their own (their text says which), kept as written.
    if BY_HAND.exists():
        out += [BY_HAND.read_text().rstrip("\n"), ""]
    path.write_text("\n".join(out))


def _in_flight(c: dict) -> list[str]:
    out = ["## 11. Streaming on a real engine: weights loaded in flight", "", c["setup"], ""]
    batch = next(r for r in c["runs"] if r["generator"] == "batch")
    out += _table(
        [
            "generator",
            "updates/s",
            "× batch",
            "reward, first 5 → last 5 updates",
            "groups trained (unique)",
            "largest staleness",
            "sequences sampled across an update",
            "log-prob gap (sampler vs learner)",
        ],
        [
            [
                r["generator"],
                r["updates_per_s"],
                r["updates_per_s"] / batch["updates_per_s"],
                f"{_f(r['reward_first5'])} → {_f(r['reward_last5'])}",
                f"{r['groups_trained']} ({r['groups_unique']})",
                r["staleness_max"],
                r["sampled_across_updates"],
                r["logprob_mismatch"],
            ]
            for r in c["runs"]
        ],
    )
    return out + [""]


def _engine_memory(c: dict) -> list[str]:
    out = [
        "## 12. The vLLM engine's memory over a long streaming run",
        "",
        f"`streamppo run` (embedded), vowels example, vLLM generator with `generation.streaming`, {c['steps']} updates "
        f"in {_f(c['wall_s'], 0)} s; the resident memory of the engine's processes (its core and worker) against the "
        "updates made so far.",
        "",
    ]
    samples = [x for x in c["samples"] if x["updates"] < c["steps"]]  # at the last update the engine shuts down
    if not samples:
        return out + ["No sample was taken.", ""]
    marks = sorted(
        {min(range(len(samples)), key=lambda i: abs(samples[i]["updates"] - u)) for u in range(0, c["steps"] + 1, 50)}
    )
    first = samples[0]["engine_rss_mib"]
    out += _table(
        ["updates", "engine RSS (MiB)", "change since the first sample (MiB)"],
        [[samples[i]["updates"], samples[i]["engine_rss_mib"], samples[i]["engine_rss_mib"] - first] for i in marks],
    )
    last = samples[-1]
    tail = [x for x in samples if x["updates"] >= last["updates"] - 170]
    out += [
        f"From {samples[0]['updates']} to {last['updates']} updates the engine grew by "
        f"{_f(last['engine_rss_mib'] - first, 0)} MiB; over the last {last['updates'] - tail[0]['updates']} updates by "
        f"{_f(last['engine_rss_mib'] - tail[0]['engine_rss_mib'])} MiB.",
    ]
    return out + [""]


def _streaming(c: dict) -> list[str]:
    out = ["## 10. Streaming rollouts (simulated compute)", "", c["setup"], ""]
    sync = next(r for r in c["runs"] if not r["streaming"] and r["max_staleness"] == 0)
    out += _table(
        [
            "generator",
            "max_staleness",
            "updates/s",
            "speed-up over synchronous",
            "bound /s (slowest stage at mean)",
            "of bound",
            "groups by staleness (versions: groups)",
            "groups dropped as stale",
        ],
        [
            [
                f"streaming, records of {r.get('groups_per_record') or 8} groups" if r["streaming"] else "batch",
                r["max_staleness"],
                r["updates_per_s"],
                r["updates_per_s"] / sync["updates_per_s"],
                r["mean_bound_per_s"],
                r["of_mean_bound"],
                ", ".join(f"{k}: {v}" for k, v in r["staleness_counts"].items()),
                r["dropped_stale"],
            ]
            for r in c["runs"]
        ],
    )
    best = max((r for r in c["runs"] if r["streaming"]), key=lambda r: r["updates_per_s"])
    batch = max((r for r in c["runs"] if not r["streaming"]), key=lambda r: r["updates_per_s"])

    def compute_s(run: dict, role: str) -> float:
        return sum(b.get("compute", 0.0) for b in run.get("breakdowns", []) if b["role"] == role)

    stage_costs = ", ".join(
        f"{'streaming in records of ' + str(r.get('groups_per_record') or 8) if r['streaming'] else 'batch'} "
        f"{_f(compute_s(r, 'advantage'), 1)} s"
        for r in c["runs"]
        if r["max_staleness"] == 2
    )
    out += [
        f"Streaming at `max_staleness` {best['max_staleness']}: **{_f(best['of_mean_bound'])}** of the bound, "
        f"**{_f(best['updates_per_s'] / sync['updates_per_s'])}×** over synchronous; batch mode's best with one "
        f"generator: {_f(batch['of_mean_bound'])} of it ({_f(batch['updates_per_s'] / sync['updates_per_s'])}×). "
        "A streamed record's staleness is its oldest group's: the version that admitted it. A long answer taken "
        "early is overtaken by shorter ones; an update waits while such a group is in flight and would be left past "
        "`max_staleness` by it (without that wait, the first measurement of this table dropped 80 and 88 of 768 "
        "groups at `max_staleness` 1 and 2, the longest answers, for the same updates/s).",
        "",
        "Each record costs the advantage service real, unscaled work whatever its rows (GAE's loop runs over every "
        "position up to the record's width), which weighs 1 / SCALE = 20 times more here than on the hardware "
        f"priced. Its compute for the 12 updates at `max_staleness` 2: {stage_costs}. Smaller records cost it more "
        "passes, but as a record is as wide as its longest response (not the profile's 2,048 tokens) it no longer "
        "holds streaming back: records of 8 and of 32 groups reach about the same rate. (The measurement before, "
        "2026-12-03, had every record 2,048 tokens wide and each process's runner waiting on the weights topic "
        "while it had groups in hand: records of 8 reached 2.69× and of 32 3.80×.)",
        "",
    ]
    return out


def _cluster(c: dict) -> list[str]:
    """Section 9: the simulated cluster (benchmarks/cluster)."""
    profiles = c["profiles"]
    out = [
        "## 9. The pipeline at cluster scale (simulated compute)",
        "",
        "**Every figure in this section is simulated.** The real services, runtime, local broker, messages of the "
        "profile's batch shape, commits, checkpoints and weight announcements run here; each model call is a wait "
        f"priced by a cost profile, × {c['scale']} so that a run takes seconds (`benchmarks/cluster/`, "
        "`python -m benchmarks.run --only cluster`). What is not scaled (encoding, Kafka hops, holds, rebalances, "
        f"this machine's 2 cores shared by every process) weighs {1 / c['scale']:.0f}× more than beside the "
        "accelerators priced, so the efficiencies are lower bounds. Weight snapshots are the tiny model's, real; "
        "writing and reading one of the profile's size is a wait at the profile's bandwidth.",
        "",
        c["setup"],
        "",
        "Cost profiles (seconds per step, unscaled; generation and learner include reading and writing a snapshot):",
        "",
    ]
    out += _table(
        ["profile", "what", "batch", "generator", "scorer", "advantage", "learner", "snapshot (GB)"],
        [
            [
                name,
                p["about"],
                f"{p['prompts']} × {p['n']}, {p['prompt_tokens']} + {p['response_tokens']} tokens",
                p["stage_s"]["generator"],
                p["stage_s"]["scorer"],
                p["stage_s"]["advantage"],
                p["stage_s"]["learner"],
                p["weight_bytes"] / 1e9,
            ]
            for name, p in profiles.items()
        ],
    )
    out += ["How the seconds follow from published figures:", "", *[f"- {line}" for line in c["derivation"]], ""]
    out += ["Sources:", "", *[f"- {key}: {text}" for key, text in c["sources"].items()], ""]
    out += [
        "### Pipeline efficiency",
        "",
        "Updates/s from the learner's first update to its last, over the ideal: 1 / (sum of stage times) at "
        "`max_staleness` 0, 1 / (slowest stage) above. *Bound* is what no implementation can beat: the slowest "
        "stage, and the loop the staleness bound closes: step s may only be sampled by the weights that trained on "
        "step s − k − 1, so k + 1 steps pass through all four stages per round of the loop, "
        "min(1 / slowest, (k + 1) / sum).",
        "",
    ]
    out += _table(
        ["profile", "max_staleness", "updates/s", "ideal /s", "efficiency", "bound /s", "of bound", "staleness seen"],
        [
            [
                r["profile"],
                r["max_staleness"],
                r["updates_per_s"],
                r["ideal_per_s"],
                r["efficiency"],
                r["bound_per_s"],
                r["efficiency_of_bound"],
                ", ".join(str(int(x)) for x in r["staleness_seen"]),
            ]
            for r in c["pipeline"]
        ],
    )
    runs = {(r["profile"], r["max_staleness"]): r for r in c["pipeline"]}
    k1, k3 = runs.get(("0.5b-balanced", 1)), runs.get(("0.5b-balanced", 3))
    heavy = runs.get(("0.5b-generation-heavy", 1))
    if k1 and k3 and heavy:
        out += [
            f"Balanced stages at `max_staleness` 1 reach **{_f(k1['efficiency_of_bound'])}** of their bound but "
            f"**{_f(k1['efficiency'])}** of the ideal 1 / slowest stage: that ideal needs a step in every stage at "
            "once, four steps in flight, and `max_staleness` k lets k + 1 be. At 3 the pipeline reaches "
            f"**{_f(k3['efficiency'])}** of it. Where one stage dominates, one step ahead is enough: generation-heavy "
            f"at 1 reaches {_f(heavy['efficiency'])}.",
            "",
        ]
    out += ["### Replicas", "", c["replicas_setup"], ""]
    out += _table(
        ["stage", "replicas", "inputs partitioned by", "batches", "seconds", "batches/s", "linear /s", "of linear"],
        [
            [
                r["role"],
                r["replicas"],
                r["partitioning"],
                r["batches"],
                r["seconds"],
                r["batches_per_s"],
                r["linear_per_s"],
                r["of_linear"],
            ]
            for r in c["replicas"]
        ],
    )
    for role in ("scorer", "generator"):
        rows = [r for r in c["replicas"] if r["role"] == role]
        most = max(r["replicas"] for r in rows)
        now = next(r for r in rows if r["replicas"] == most and r["partitioning"].startswith("step"))
        before = next((r for r in rows if r["replicas"] == most and r["partitioning"].startswith("key")), None)
        if before:
            out += [
                f"{most} {role}s: **{_f(now['of_linear'])}** of linear, against {_f(before['of_linear'])} before, when "
                "batches went to the partition their id hashed to: replicas own partitions, and the busiest one set "
                "the pace.",
                "",
            ]
    out += ["### Long-tailed response lengths", "", c["long_tail_setup"], ""]
    sync = next(r for r in c["long_tail"] if r["max_staleness"] == 0)
    dealt = {"roundrobin": "round-robin (now)", "range": "in blocks (before)"}
    out += _table(
        [
            "max_staleness",
            "generators",
            "partitions dealt",
            "updates/s",
            "speed-up over synchronous",
            "bound /s",
            "of bound",
        ],
        [
            [
                r["max_staleness"],
                r["generators"],
                dealt[r.get("assignment", "range")],
                r["updates_per_s"],
                r["updates_per_s"] / sync["updates_per_s"],
                r["bound_per_s"],
                r["efficiency_of_bound"],
            ]
            for r in c["long_tail"]
        ],
    )
    best = max((r for r in c["long_tail"] if r.get("assignment") == "roundrobin"), key=lambda r: r["updates_per_s"])
    one = next(r for r in c["long_tail"] if r["max_staleness"] == 1)
    out += [
        "Published speed-ups over synchronous, on the same GPUs: verl one-step-off 1.23–1.40×, verl fully async "
        "2.35–2.67× (7B, 128 GPUs), AReaL v0.3 2.77× (1.5B). Here one step ahead gives "
        f"**{_f(one['updates_per_s'] / sync['updates_per_s'])}×** (generation overlaps the other stages), and "
        f"`max_staleness` 2 with two generators **{_f(best['updates_per_s'] / sync['updates_per_s'])}×** (two "
        "batches generate at once). What it takes here: generators enough that generation is no longer the slowest "
        "stage, and a staleness bound that lets them work on different steps. The anchors are measured end to end "
        "on real GPUs, these are simulated. Every batch here waits for its longest answer: section 10 measures the "
        "streaming generator, whose groups go on as they finish.",
        "",
    ]
    out += ["### One hop against batch size", "", c["per_hop_setup"], ""]
    out += _table(
        ["batch", "path", "MB", "encode", "produce", "fetch", "decode", "commit", "hop (s)", "of a step"],
        [
            [
                h["batch"],
                h["path"],
                h["mb"],
                h["encode"],
                h["produce"],
                h["fetch"],
                h["decode"],
                h["commit"],
                h["hop_s"],
                f"{100 * h['of_step']:.2f}%" if h.get("of_step") is not None else "",
            ]
            for h in c["per_hop"]
        ],
    )
    hops = {(h["batch"].split(":")[0], h["path"]): h for h in c["per_hop"]}
    if ("0.5B", "inline") in hops and ("7B", "inline") in hops:
        out += [
            f"At the 0.5B batch one hop costs {100 * hops[('0.5B', 'inline')]['of_step']:.2f}% of a balanced step "
            f"inline and {100 * hops[('0.5B', 'by reference')]['of_step']:.2f}% by reference (four hops a step). "
            f"The 7B experience batch ({_f(hops[('7B', 'inline')]['mb'])} MB) does not fit a record at the "
            "pipeline's default limit of 64 MB, nor Apache Kafka's default of 1 MB; inline, with the limit raised "
            f"for this measurement, its hop takes {_f(hops[('7B', 'inline')]['hop_s'])} s against "
            f"{_f(hops[('7B', 'by reference')]['hop_s'])} s by reference. By reference is the faster hop from the "
            "sub-megabyte batch up (kafka-python's produce and fetch copy the bytes several times), so batches over "
            "`pipeline.inline_max_bytes`, 1 MiB by default, now travel by reference.",
            "",
        ]
    return out
