"""The ``streamppo`` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import warnings
from pathlib import Path

import yaml

from services.ops.runlog.commands import add_log_commands
from services.roles import ROLES
from services.runtime import exit_codes

__all__ = ["build_parser", "main"]


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
    from services.launch.fleet import RunsFolder, parse_quotas, parse_shares
    from services.launch.process import serve_fleet

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


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence as plain text (Sphinx roles and literals unwrapped)."""
    import re

    text = " ".join(doc.split())
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text).replace("``", "")
    end = re.search(r"\.(\s|$)", text)
    return text[: end.start() + 1] if end else text


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


def _models(args) -> int:
    from common.config import ConfigError
    from common.models import builtin_models, resolve_model

    if args.action == "merge":
        from services.learner.export import merge_adapter

        if args.out is None:
            raise ConfigError("models merge ADAPTER_FOLDER --out FOLDER: where to write the merged model")
        base = resolve_model(args.base, args.cache_dir) if args.base else None
        print(f"merged into {merge_adapter(Path(args.name), args.out, base)}")
        return 0
    if args.action == "list":
        for name, (build, _revision) in builtin_models().items():
            print(f"builtin:{name:<24} {_first_sentence(build.__doc__ or '')}")
        return 0
    names = list(builtin_models()) if args.name == "all" else [args.name.removeprefix("builtin:")]
    for name in names:
        print(resolve_model(f"builtin:{name}", args.cache_dir))
    return 0


def _train_rm(args) -> int:
    from common.models import resolve_model
    from recipes.reward_model import RewardTrainingConfig, load_pairs, train_reward_model

    try:
        pairs = load_pairs(args.pairs)
        cfg = RewardTrainingConfig(
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            eval_fraction=args.eval_fraction,
            max_length=args.max_length,
            seed=args.seed,
        )
        report = train_reward_model(resolve_model(args.base, args.cache_dir), pairs, args.out, cfg)
    except (OSError, ValueError) as exc:
        print(f"streamppo: {exc}", file=sys.stderr)
        return 2
    print(
        f"reward model saved to {args.out}: held-out pairwise accuracy {report['eval_accuracy_before']:.3f} -> "
        f"{report['eval_accuracy']:.3f} on {report['eval_pairs']} pairs ({report['train_pairs']} trained on)"
    )
    return 0


def _report(args) -> int:
    from common.report import format_summary, write_report

    try:
        paths, summary = write_report(args.run_dir, tensorboard=args.tensorboard)
    except ImportError as exc:
        print(f"streamppo: the report needs matplotlib (make venv EXTRAS=plots): {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"streamppo: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    print(f"plots: {', '.join(p.name for p in paths)} in {paths[0].parent}")
    return 0


def _protos(args) -> int:
    from common.schema import MESSAGE_TYPES, describe

    stale = []
    for name, cls in MESSAGE_TYPES.items():
        path = args.dir / f"{name}.yaml"
        text = (
            "# Generated from common/schema.py by `streamppo protos --write`; "
            "tests/test_schema.py holds the codec to it.\n"
        )
        text += yaml.safe_dump(describe(cls), sort_keys=False, allow_unicode=True, width=120)
        if args.write:
            path.write_text(text)
        elif not path.is_file() or path.read_text() != text:
            stale.append(path.name)
    if stale:
        print(f"protos out of date: {', '.join(stale)} (run `streamppo protos --write`)", file=sys.stderr)
        return 1
    return 0


def _config_reference(args) -> int:
    from common.config import reference

    text = reference()
    if args.write is None:
        print(text, end="")
        return 0
    args.write.write_text(text)
    print(f"wrote {args.write}")
    return 0


def _config_options(parser: argparse.ArgumentParser, broker: bool = False, required: bool = True) -> None:
    parser.add_argument("--config", required=required, type=Path, help="YAML run configuration")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config entry, e.g. --set run.steps=10 (repeatable; ${SETTINGS_VARIABLE} holds more, "
        "separated by spaces, that --set overrides)",
    )
    if broker:
        parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: kafka.bootstrap)")


def _metrics_options(parser) -> None:
    parser.add_argument(
        "--metrics-port",
        default=None,
        metavar="PORT|FIRST-LAST",
        help="serve Prometheus /metrics on this port, or on the first free one of a range (replicas on one host)",
    )
    parser.add_argument("--metrics-address", default="0.0.0.0", help="the address /metrics listens on")
    parser.add_argument(
        "--metrics-targets",
        type=Path,
        default=None,
        metavar="DIR",
        help="register /metrics in DIR for Prometheus' file-based discovery (file_sd_configs)",
    )


def _add_pipeline_commands(sub) -> None:
    """``run``, one command per role of ROLES, ``topics`` and ``up``."""
    run = sub.add_parser("run", help="run the whole pipeline in one process over the in-memory bus")
    _config_options(run)
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(handler=_run)

    for role in ROLES.values():
        serve = sub.add_parser(role.name, aliases=list(role.aliases), help=f"{role.summary} (over Kafka)")
        _config_options(serve, broker=True)
        serve.add_argument("--replica-id", default=None, help="default: role-host-pid, or role-<container id>")
        _metrics_options(serve)
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
    _metrics_options(fleet)
    fleet.set_defaults(handler=_fleet)

    topics = sub.add_parser("topics", help="create the pipeline's topics (and their .dlq) on the broker, then exit")
    _config_options(topics, broker=True)
    topics.set_defaults(handler=_topics)

    status = sub.add_parser(
        "status", help="what each replica of the run does, what it waits for, weights, dead letters"
    )
    _config_options(status, broker=True, required=False)
    status.add_argument(
        "--run-dir", type=Path, help="a run `streamppo up` ran: its settings and broker, without --config"
    )
    status.set_defaults(handler=_status)

    wait = sub.add_parser(
        "wait", help="follow a run that services elsewhere serve (compose, Helm) until it is done; its summary"
    )
    _config_options(wait, broker=True)
    wait.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="give up (exit 1) after this")
    wait.set_defaults(handler=_wait)

    agents = sub.add_parser(
        "agents", help="run your agent on the episodes of a gateway run (gateway.agent.function, or --function)"
    )
    _config_options(agents)
    agents.add_argument(
        "--gateway", action="append", default=[], metavar="URL",
        help="a gateway to take episodes from (repeatable; default: gateway.public_url, or HOST:the first PORT)",
    )  # fmt: skip
    agents.add_argument("--function", default=None, help="module:function or path/to/file.py:function")
    agents.add_argument("--workers", type=int, default=None, help="episodes run at once (default gateway.agent's)")
    agents.add_argument("--name", default="agents", help="what the gateway records as the agent")
    agents.set_defaults(handler=_agents)

    cluster = sub.add_parser("up", help="run every service as its own process over a local (or given) broker")
    _config_options(cluster, required=False)
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


def _add_tool_commands(sub) -> None:
    """``models``, ``train-rm``, ``report`` and ``protos``."""
    default_cache = Path.home() / ".cache" / "streamppo"
    models = sub.add_parser(
        "models", help="list the builtin models, prepare one (build / convert) into the cache, or merge a LoRA adapter"
    )
    models.add_argument("action", choices=["list", "prepare", "merge"])
    models.add_argument(
        "name",
        nargs="?",
        default="all",
        help="prepare: e.g. smollm2-135m-instruct (default: all); merge: a LoRA "
        "run's adapter folder (<run dir>/final/actor)",
    )
    models.add_argument("--out", type=Path, default=None, help="merge: the folder of the merged model")
    models.add_argument(
        "--base",
        default=None,
        help="merge: the base model's folder or builtin:<name> (default: the one the adapter names)",
    )
    models.add_argument("--cache-dir", type=Path, default=default_cache)
    models.set_defaults(handler=_models)

    train_rm = sub.add_parser("train-rm", help="train a reward model on preference pairs (Bradley-Terry)")
    train_rm.add_argument("--pairs", required=True, type=Path, help="JSONL: prompt, chosen, rejected per line")
    train_rm.add_argument("--base", default="builtin:all-minilm-l6-v2", help="model folder or builtin:<name>")
    train_rm.add_argument("--out", required=True, type=Path, help="folder to save the reward model in")
    train_rm.add_argument("--epochs", type=int, default=2)
    train_rm.add_argument("--batch-size", type=int, default=16)
    train_rm.add_argument("--lr", type=float, default=5e-5)
    train_rm.add_argument("--eval-fraction", type=float, default=0.2, help="share of pairs held out for accuracy")
    train_rm.add_argument("--max-length", type=int, default=256)
    train_rm.add_argument("--seed", type=int, default=0)
    train_rm.add_argument("--cache-dir", type=Path, default=default_cache)
    train_rm.set_defaults(handler=_train_rm)

    report = sub.add_parser("report", help="plots (PNG) and a summary table of a run directory")
    report.add_argument("run_dir", type=Path)
    report.add_argument("--tensorboard", action="store_true", help="also write TensorBoard scalars")
    report.set_defaults(handler=_report)

    reference = sub.add_parser(
        "config-reference", help="every setting of a run config: type, default, bounds, meaning (Markdown)"
    )
    reference.add_argument("--write", type=Path, default=None, metavar="FILE", help="e.g. docs/config-reference.md")
    reference.set_defaults(handler=_config_reference)

    protos = sub.add_parser("protos", help="check (or --write) protos/ against the message definitions")
    protos.add_argument("--write", action="store_true")
    protos.add_argument("--dir", type=Path, default=Path("protos"), help="the protos folder (default: ./protos)")
    protos.set_defaults(handler=_protos)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamppo", description="RLHF-PPO as services over a message bus.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_pipeline_commands(sub)
    _add_tool_commands(sub)
    add_log_commands(sub)
    return parser


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # transformers logs a load report, advisory warnings and progress bars for every model, vLLM every engine step;
    # the services log what matters themselves. Both read these when they are imported, which a command that loads
    # no model (status, topics) never does; child processes (vLLM's engine) inherit them.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # vLLM's engine processes inherit these: without -v they say errors only (its start-up advice about Triton,
    # tcmalloc and eager mode is for vLLM's own developers), nor do torch's C++ warnings and library FutureWarnings.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    if not verbose:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        # torch's Python loggers: on a CPU, PyPI's torch (a CUDA build) says at import that Triton is missing, which
        # deploy/install.py removes there on purpose.
        os.environ.setdefault("TORCH_LOGS", "-torch")
        os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
        if os.environ["PYTHONWARNINGS"] == "ignore::FutureWarning":  # and this process, which read it at its start
            warnings.filterwarnings("ignore", category=FutureWarning)
    # kafka-python logs every connection it opens and closes at INFO, every failed attempt at ERROR; the services
    # report broker trouble once themselves.
    logging.getLogger("kafka").setLevel(logging.WARNING if verbose else logging.CRITICAL)
    # PyPI's torch is a CUDA build: on a machine without triton it warns, at import, that flop counting of triton
    # kernels will not work (streamppo counts no flops), whatever TORCH_LOGS says once -v is given.
    logging.getLogger("torch.utils.flop_counter").setLevel(logging.ERROR)
    if not verbose:
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # run.trackers: its store's migrations at INFO


def _dispatch(args) -> int:
    """Run the command's handler; the errors a user can fix become one line on stderr and an exit code."""
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print(f"streamppo {args.command}: stopped by Ctrl-C (or SIGTERM)", file=sys.stderr)
        return exit_codes.INTERRUPTED
    except Exception as exc:
        code = _exit_code_of(exc)
        if code is None:
            raise
        print(f"streamppo: {exc.strerror if code == exit_codes.NO_SPACE else exc}", file=sys.stderr)
        return code


def _exit_code_of(exc: Exception) -> int | None:
    """The exit code of an error a user can fix, None for any other. Imported here, on an error only: the modules
    load torch, which a command such as ``status`` otherwise never needs (seconds)."""
    from common.config import ConfigError
    from common.data import DatasetError
    from common.models import ModelLoadError
    from common.named import NamedError
    from common.rewards import RewardError
    from common.storage import NoSpaceError
    from services.transport import TopicMismatch
    from services.transport.kafka import BrokerUnavailable

    if isinstance(exc, (ConfigError, TopicMismatch, ModelLoadError, RewardError, DatasetError, NamedError)):
        # What a setting names that cannot be had (a prompt file, a reward function, a model folder): a restart
        # cannot cure it, and a supervisor must not try.
        return exit_codes.CONFIG
    if isinstance(exc, BrokerUnavailable):
        return exit_codes.ERROR
    if isinstance(exc, NoSpaceError):
        return exit_codes.NO_SPACE
    return None


SETTINGS_VARIABLE = "STREAMPPO_SET"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "set"):
        # Settings for every command of a deployment (one compose override for all its services); --set wins.
        args.set = [*os.environ.get(SETTINGS_VARIABLE, "").split(), *args.set]
    _configure_logging(args.verbose)
    return _dispatch(args)


if __name__ == "__main__":
    sys.exit(main())
