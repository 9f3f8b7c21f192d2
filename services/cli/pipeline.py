"""The pipeline's commands: ``run`` (embedded), one per role (over Kafka), ``fleet``, ``topics``, ``status``, ``wait``,
``agents`` and ``up``."""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path

from services.cli.options import config_options, metrics_options
from services.roles import ROLES
from services.runtime import exit_codes


def _run(args) -> int:
    from common.config import load_config
    from services.launch.embedded import run_embedded
    from services.launch.preflight import check_run_inputs

    config = load_config(args.config, args.set)
    check_run_inputs(config)  # the prompts, the reward, the models' folders: found wrong before any model loads
    # SIGTERM ends the run as Ctrl-C does, through the runner's cleanup: by default it would end the process at
    # once and leave the vLLM engine's processes running, orphaned, with the model in memory.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    summary = run_embedded(config, progress=not args.no_progress)
    print(summary.done_line())
    return exit_codes.RUN_SHORT if summary.ended_short else 0


def _serve(args) -> int:
    from common.config import load_config
    from services.launch.process import serve

    config = load_config(args.config, [*args.set, *(["run.resume=true"] if args.resume else [])])
    return serve(
        args.role,
        config,
        args.bootstrap,
        args.replica_id,
        args.metrics_port,
        args.metrics_address,
        args.metrics_targets,
    )


def _fleet(args) -> int:
    from common.config import ConfigError
    from services.launch.fleet import RunsFolder, parse_quotas, parse_shares, serve_fleet

    if not args.runs.is_dir():
        raise ConfigError(f"--runs {args.runs}: not a folder")
    try:
        shares, quotas = parse_shares(args.share), parse_quotas(args.quota)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return serve_fleet(
        args.role,
        RunsFolder(args.runs, args.set),
        shares,
        args.bootstrap,
        args.replica_id,
        quotas,
        args.metrics_port,
        args.metrics_address,
        args.metrics_targets,
    )


def _topics(args) -> int:
    from common.config import load_config
    from services.ops.status import format_replication
    from services.roles import pipeline_topics
    from services.runtime.run_bus import kafka_bus

    config = load_config(args.config, args.set)
    bus = kafka_bus(config, args.bootstrap, replace_wrong_topics=True)  # creates (or replaces) what is missing
    try:
        brokers, replication = bus.replication([spec.name for spec in pipeline_topics()])
    finally:
        bus.close()
    print(f"topics ready ({config.kafka.partitions} partitions each; weights compacted)")
    print(format_replication(brokers, replication))
    return 0


STATUS_CONNECT_S = 5.0  # how long `status` waits for a broker before it answers from the run directory


def _status(args) -> int:
    from kafka.errors import KafkaError

    from services.ops.status import format_status, from_the_run_directory, read_status, save_status
    from services.roles import LOG_TOPIC
    from services.runtime.run_bus import kafka_bus, run_of
    from services.transport.kafka import BrokerUnavailable

    config, bootstrap = run_of(args.config, args.set, args.run_dir, args.bootstrap)
    run_dir = Path(args.run_dir or config.run.dir)
    finished = _finished_run(run_dir)
    if finished is not None:
        # The run directory says how it ended; its broker is usually gone with it (up stops the one it started), so
        # the replicas' last reports are shown only where it answers at once.
        print(finished)
        config = config.model_copy(update={"kafka": config.kafka.model_copy(update={"connect_timeout_s": 2.0})})
        try:
            bus = kafka_bus(config, bootstrap, make=False)
            print(format_status(read_status(bus, config.run.run_id, timeout_s=5.0)))
            bus.close()
        except Exception:  # no broker: the line above is the answer
            pass
        return 0
    patience = min(config.kafka.connect_timeout_s, STATUS_CONNECT_S)
    config = config.model_copy(update={"kafka": config.kafka.model_copy(update={"connect_timeout_s": patience})})
    try:
        bus = kafka_bus(config, bootstrap, make=False)  # a reader: it makes no topics
        try:
            if bus.log_identity(LOG_TOPIC) is None:
                print(
                    f"streamppo: no log of run {config.run.run_id!r} (namespace {config.namespace!r}) on this broker: "
                    "the run has not started, or the broker lost its data",
                    file=sys.stderr,
                )
                return exit_codes.ERROR
            status = read_status(bus, config.run.run_id)
        finally:
            bus.close()
    except (BrokerUnavailable, KafkaError) as exc:
        print(f"streamppo: the broker does not answer: {exc}", file=sys.stderr)
        print(from_the_run_directory(run_dir))
        return exit_codes.ERROR
    save_status(run_dir, status)
    print(format_status(status))
    return 0


def _finished_run(run_dir: Path) -> str | None:
    """``finished: done ...`` for a run directory whose run is over (its summary.json written at the end), else None."""
    from services.ops.summary import RunSummary

    written, metrics = run_dir / "summary.json", run_dir / "metrics.jsonl"
    try:
        summary = RunSummary(**json.loads(written.read_text()))
        if metrics.exists() and metrics.stat().st_mtime > written.stat().st_mtime:
            return None  # updates since it was written: a run resumed after it ended
    except (OSError, ValueError, TypeError):
        return None
    return "finished: " + summary.done_line()


def _wait(args) -> int:
    from common.config import load_config
    from services.ops.status import wait_for_run
    from services.ops.summary import summarise_run
    from services.roles import roles_of
    from services.runtime.run_bus import kafka_bus

    config = load_config(args.config, args.set)
    ending = {role.name for role in roles_of(config) if role.ends_run}
    bus = kafka_bus(config, args.bootstrap, make=False)  # a reader: it makes no topics
    try:
        status = wait_for_run(bus, config.run.run_id, ending, config.run.steps, timeout_s=args.timeout)
    finally:
        bus.close()
    if status is None:
        return exit_codes.ERROR
    run_dir = Path(config.run.dir)
    if (run_dir / "metrics.jsonl").is_file():
        summary = summarise_run(run_dir, sum(status.dead_letters.values()), config.run.steps)
        print(summary.done_line())
        return exit_codes.RUN_SHORT if summary.ended_short else 0
    else:  # the run directory is on a volume this process does not see
        print(f"done: {', '.join(f'{m} v{v}' for m, v in sorted(status.weights.items()))}; run directory {run_dir}")
    return 0


def _agents(args) -> int:
    from common.config import ConfigError, load_config
    from services.gateway.agents import AgentPool

    config = load_config(args.config, args.set)
    gateway = config.gateway
    if gateway is None:
        raise ConfigError("streamppo agents runs the episodes of a gateway run: the config has no gateway section")
    function = args.function or (gateway.agent.function if gateway.agent is not None else None)
    if function is None:
        raise ConfigError("no agent to run: give --function module:function, or set gateway.agent.function")
    workers = args.workers or (gateway.agent.workers if gateway.agent is not None else 8)
    urls = args.gateway or [gateway.public_url or f"http://{gateway.host}:{gateway.port.partition('-')[0]}"]
    pool = AgentPool(function, urls, workers, name=args.name)
    print(f"{workers} agents running {function} on the episodes of {', '.join(urls)} (Ctrl-C stops them)", flush=True)
    ended = _end_with_the_run(config, pool)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        pool.run()
    except KeyboardInterrupt:
        pass
    print(f"{pool.done} episodes run; {ended.get('why', 'stopped')}", flush=True)
    return 0


def _end_with_the_run(config, pool) -> dict:
    """Stop ``pool`` once the run is done, as `streamppo wait` sees it on the run's broker (the learner's report),
    so that a remote agents job completes; returns what says why it ended (filled in then)."""
    import threading

    from services.ops.status import wait_for_run
    from services.roles import ROLES, roles_of
    from services.runtime.run_bus import kafka_bus

    ended: dict = {}
    if not config.kafka.bootstrap:
        return ended

    def follow() -> None:
        try:
            bus = kafka_bus(config, make=False)
            ending = {role.name for role in roles_of(config) if ROLES[role.name].ends_run}
            status = wait_for_run(bus, config.run.run_id, ending, config.run.steps, say=lambda *a, **k: None)
        except Exception as exc:  # the run's broker gone too: the pool goes on until stopped by hand
            logging.getLogger(__name__).info("agents: cannot follow the run on its broker: %s", exc)
            return
        if status is not None:
            version = status.weights.get("actor")
            ended["why"] = f"the run is done (actor v{version} of {config.run.steps})"
            pool.stopping.set()

    threading.Thread(target=follow, name="agents-follow-run", daemon=True).start()
    return ended


def _up(args) -> int:
    from common.config import ConfigError, load_config
    from services.launch.cluster import parse_replicas, resumed_run, up
    from services.launch.preflight import check_broker_answers, check_run_inputs
    from services.runtime.run_bus import bootstrap_of

    overrides = [*args.set, *(["run.resume=true"] if args.resume else [])]
    config_path, replica_specs = args.config, args.replicas
    if config_path is None:
        if not (args.resume and args.run_dir is not None):
            raise ConfigError("name the run: --config FILE, or --resume --run-dir DIR of a run up ran before")
        config_path, saved = resumed_run(args.run_dir)  # its settings and replicas, as up ran it
        replica_specs = [*saved, *replica_specs]
    config = load_config(config_path, overrides)
    check_run_inputs(config)  # fail here, once, rather than in every child
    if args.bootstrap is not None:
        check_broker_answers(bootstrap_of(config, args.bootstrap))
    try:
        replicas = parse_replicas(replica_specs, config)
    except ValueError as exc:
        print(f"streamppo: {exc}", file=sys.stderr)
        return exit_codes.CONFIG
    return up(
        config_path,
        overrides,
        args.bootstrap,
        replicas,
        verbose=args.verbose,
        restart=args.restart,
        config=config,
        broker=args.broker,
    )


def add_pipeline_commands(sub) -> None:
    """``run``, one command per role of ROLES, ``topics`` and ``up``."""
    run = sub.add_parser("run", help="run the whole pipeline in one process over the in-memory bus")
    config_options(run)
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(handler=_run)

    for role in ROLES.values():
        serve = sub.add_parser(role.name, aliases=list(role.aliases), help=f"{role.summary} (over Kafka)")
        config_options(serve, broker=True)
        serve.add_argument("--replica-id", default=None, help="default: role-host-pid, or role-<container id>")
        metrics_options(serve)
        serve.add_argument("--resume", action="store_true", help="continue from the learner's last checkpoint")
        serve.set_defaults(handler=_serve, role=role.name)

    fleet = sub.add_parser(
        "fleet", help="one replica of a role serving several runs, one config file each in a folder (over Kafka)"
    )
    fleet.add_argument("role", choices=[r.name for r in ROLES.values() if r.input_topic and not r.ends_run])
    fleet.add_argument("--runs", type=Path, required=True, metavar="DIR", help="a config file (*.yaml) per run")
    fleet.add_argument("--share", action="append", default=[], metavar="RUN_ID=WEIGHT", help="a run's share (1)")
    fleet.add_argument("--bootstrap", default=None, help="the broker (default: each run's kafka.bootstrap)")
    fleet.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting for every run")
    fleet.add_argument(
        "--quota", action="append", default=[], metavar="RUN_ID=TOKENS_PER_S", help="a run's most tokens/s (none)"
    )
    fleet.add_argument("--replica-id", default=None, help="default: role-host-pid, or role-<container id>")
    metrics_options(fleet)
    fleet.set_defaults(handler=_fleet)

    topics = sub.add_parser("topics", help="create the pipeline's topics (and their .dlq) on the broker, then exit")
    config_options(topics, broker=True)
    topics.set_defaults(handler=_topics)

    status = sub.add_parser(
        "status", help="what each replica of the run does, what it waits for, weights, dead letters"
    )
    config_options(status, broker=True, required=False)
    status.add_argument(
        "--run-dir", type=Path, help="a run `streamppo up` ran: its settings and broker, without --config"
    )
    status.set_defaults(handler=_status)

    wait = sub.add_parser(
        "wait", help="follow a run that services elsewhere serve (compose, Helm) until it is done; its summary"
    )
    config_options(wait, broker=True)
    wait.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="give up (exit 1) after this")
    wait.set_defaults(handler=_wait)

    agents = sub.add_parser(
        "agents", help="run your agent on the episodes of a gateway run (gateway.agent.function, or --function)"
    )
    config_options(agents)
    agents.add_argument(
        "--gateway", action="append", default=[], metavar="URL",
        help="a gateway to take episodes from (repeatable; default: gateway.public_url, or HOST:the first PORT)",
    )  # fmt: skip
    agents.add_argument("--function", default=None, help="module:function or path/to/file.py:function")
    agents.add_argument("--workers", type=int, default=None, help="episodes run at once (default gateway.agent's)")
    agents.add_argument("--name", default="agents", help="what the gateway records as the agent")
    agents.set_defaults(handler=_agents)

    cluster = sub.add_parser("up", help="run every service as its own process over a local (or given) broker")
    config_options(cluster, required=False)
    cluster.add_argument(
        "--run-dir", type=Path, default=None,
        help="with --resume and no --config: the run as up ran it there (its settings and replicas)",
    )  # fmt: skip
    cluster.add_argument("--bootstrap", default=None, help="use this broker instead of starting a local one")
    cluster.add_argument(
        "--broker",
        choices=["kafka", "memory"],
        default="kafka",
        help="the broker up starts: Apache Kafka, its log in the run directory (default; the memory broker where "
        "Java is missing, saying so), or the memory broker (nothing kept when it stops)",
    )
    cluster.add_argument("--replicas", action="append", default=[], metavar="ROLE=N", help="e.g. --replicas scorer=2")
    cluster.add_argument(
        "--resume", action="store_true", help="continue from the learner's last checkpoint (e.g. on a new broker)"
    )
    cluster.add_argument(
        "--restart",
        choices=["on-failure", "never"],
        default="on-failure",
        help="restart a crashed service with back-off (default), or stop the run",
    )
    cluster.set_defaults(handler=_up)
