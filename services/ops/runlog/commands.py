"""The log tools' commands: ``streamppo archive``, ``trace``, ``export``, ``rescore``, ``replay``.

Each reads a run's log from an archive folder (``--log DIR``) or from the broker the run's config names
(``--config``, ``--bootstrap``), and names what it could not read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.runtime import exit_codes

__all__ = ["add_log_commands"]


def _log_options(parser: argparse.ArgumentParser, config_required: bool = False) -> None:
    parser.add_argument(
        "--log", type=Path, help="an archived log (streamppo archive, or run.archive_log's <run.dir>/log)"
    )
    parser.add_argument("--config", type=Path, required=config_required, help="the run's YAML configuration")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config entry")
    parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: kafka.bootstrap)")
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="the run's directory (its metrics.jsonl; default run.dir); of a run `streamppo up` ran, also its settings "
        "and broker, without --config",
    )


def _open(args):
    """``(reader, config or None, run_dir or None)`` for the log the arguments name."""
    from common.config import load_config
    from services.ops.runlog.reader import ArchiveReader, BusReader

    if args.log is not None:
        config = load_config(args.config, args.set) if args.config else None
        run_dir = args.run_dir or (config.run.dir if config else None)
        reader = ArchiveReader.open(args.log)
        if run_dir is None and (args.log.parent / "metrics.jsonl").exists():
            run_dir = args.log.parent  # an embedded run's <run.dir>/log
        return reader, config, run_dir
    if args.config is None and args.run_dir is None:
        raise SystemExit(
            "streamppo: name the log: --log DIR (an archive), --config or --run-dir (the run on its broker)"
        )
    from services.roles import pipeline_topics
    from services.runtime.run_bus import kafka_bus, run_of

    config, bootstrap = run_of(args.config, args.set, args.run_dir, args.bootstrap)
    run_dir = args.run_dir or config.run.dir
    bus = kafka_bus(config, bootstrap, make=False)
    partitions = {spec.name: spec.partitions for spec in pipeline_topics(config.kafka.partitions)}
    return BusReader(bus=bus, partitions=partitions), config, run_dir


def _say_unreadable(reader) -> None:
    for u in reader.unreadable[:10]:
        print(f"streamppo: skipped {u.topic}:{u.partition}:{u.offset}: {u.error}", file=sys.stderr)
    if len(reader.unreadable) > 10:
        print(f"streamppo: ... {len(reader.unreadable)} records skipped in all", file=sys.stderr)


def _archive(args) -> int:
    from services.ops.runlog.archive import archive_bus
    from services.runtime.run_bus import kafka_bus, run_of

    config, bootstrap = run_of(args.config, args.set, args.run_dir, args.bootstrap)
    bus = kafka_bus(config, bootstrap, make=False)
    try:
        manifest = archive_bus(bus, args.out, config.run.run_id, config.kafka.partitions)
    finally:
        bus.close()
    records = sum(topic["records"] for topic in manifest["topics"].values())
    print(f"{records} records of run {config.run.run_id!r} archived in {args.out}")
    for missing in manifest["missing_batch_files"]:
        print(f"streamppo: not kept: {missing}", file=sys.stderr)
    return 0


def _trace(args) -> int:
    from services.ops.runlog.trace import LogIndex, format_trace, trace_prompt, trace_update

    reader, _, run_dir = _open(args)
    index = LogIndex(reader, run_dir)
    _say_unreadable(reader)
    try:
        answer = trace_update(index, args.update) if args.update is not None else trace_prompt(index, args.prompt)
    except LookupError as exc:
        print(f"streamppo: {exc.args[0]}", file=sys.stderr)
        return exit_codes.ERROR
    print(json.dumps(answer, indent=2) if args.json else format_trace(answer))
    return 0


def _export(args) -> int:
    from services.ops.runlog.export import export_parquet

    reader, _, run_dir = _open(args)
    counts = export_parquet(reader, args.out, run_dir)
    _say_unreadable(reader)
    print(", ".join(f"{n} {name} rows" for name, n in counts.items()) + f" in {args.out}")
    return 0


def _scoring_config(path: Path, overrides: list[str], base):
    """The config whose reward section scores again: ``path`` a whole run config, or a file of the reward section
    alone (``reward: {...}``, or its keys at the top), on the run's own settings (``base``) where there are any."""
    import yaml

    from common.config import ConfigError, RewardSection, RunConfig, load_config

    try:
        tree = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--reward-config {path}: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"--reward-config {path} must hold a mapping: a run config, or its reward section")
    if set(tree) - {"reward"} - set(RewardSection.model_fields):
        return load_config(path, overrides)  # a whole run config
    reward = dict(tree.get("reward", tree))
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key.startswith("reward.") or "." in key.removeprefix("reward."):
            raise ConfigError(f"--reward-set {override!r}: a reward-only file takes reward.KEY=VALUE")
        reward[key.removeprefix("reward.")] = yaml.safe_load(value)
    if base is None:  # no run config at hand: the defaults (a reward model or judge from the default model cache)
        base = RunConfig.model_validate({"model": {"actor": "-"}, "data": {"prompts": "-"}, "reward": reward})
    try:
        return base.model_copy(update={"reward": RewardSection.model_validate(reward)})
    except ValueError as exc:
        raise ConfigError(f"--reward-config {path}: the reward section is not valid: {exc}") from None


def _rescore(args) -> int:
    from common.rewards import load_reward
    from services.ops.runlog.rescore import rescore
    from services.runtime.run_bus import RUN_CONFIG

    reader, config, run_dir = _open(args)
    if config is None and run_dir is not None and (Path(run_dir) / RUN_CONFIG).is_file():
        from common.config import load_config

        config = load_config(Path(run_dir) / RUN_CONFIG)  # the run's own settings (its model cache, device)
    scoring = _scoring_config(args.reward_config, args.reward_set, config)
    reward, reward_id = load_reward(scoring)
    try:
        summary = rescore(reader, reward, reward_id, args.out, top=args.top)
    finally:
        reward.close()
    _say_unreadable(reader)
    print(
        f"{summary['responses']} responses rescored: mean {summary['old_mean']} -> {summary['new_mean']}, "
        f"Spearman {summary['spearman']}; {args.out}/report.md"
    )
    return 0


def _replay(args) -> int:
    from common.config import load_config
    from services.ops.runlog.replay import replay

    reader, config, run_dir = _open(args)
    if run_dir is None:
        raise SystemExit("streamppo: replay needs the run's directory (its metrics.jsonl): --run-dir")
    if config is None:  # the configuration the run wrote, overrides included
        config = load_config(Path(run_dir) / "config.json", args.set)
    result = replay(reader, config, Path(run_dir), args.out, args.from_checkpoint)
    _say_unreadable(reader)
    for check in result.checked:
        verdict = "same" if check["match"] else ("not announced" if check["announced"] is None else "DIFFERS")
        print(f"v{check['version']} {check['model']}: {verdict} {check['replayed']}")
    if result.mismatches:
        first = result.mismatches[0]
        print(
            f"streamppo: replay differs from the run from v{first['version']} ({first['model']}: announced "
            f"{first['announced']})",
            file=sys.stderr,
        )
        return exit_codes.ERROR
    print(f"replayed v{result.start + 1}..v{result.checked[-1]['version']}: every digest as announced")
    return 0


def add_log_commands(sub) -> None:
    archive = sub.add_parser("archive", help="write a run's log from its broker into a folder of files")
    archive.add_argument("--config", type=Path, help="the run's YAML configuration")
    archive.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config entry")
    archive.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: kafka.bootstrap)")
    archive.add_argument(
        "--run-dir", type=Path, help="a run `streamppo up` ran: its settings and broker, without --config"
    )
    archive.add_argument("--out", type=Path, required=True, help="a new folder")
    archive.set_defaults(handler=_archive)

    trace = sub.add_parser("trace", help="what made an update, or which updates a prompt's samples trained")
    _log_options(trace)
    which = trace.add_mutually_exclusive_group(required=True)
    which.add_argument("--update", type=int, help="the update (the policy version it made)")
    which.add_argument("--prompt", type=int, help="a dataset row")
    trace.add_argument("--json", action="store_true", help="JSON instead of plain text")
    trace.set_defaults(handler=_trace)

    export = sub.add_parser("export", help="a run's rollouts and experience as Parquet, one row per response")
    _log_options(export)
    export.add_argument("--out", type=Path, required=True)
    export.set_defaults(handler=_export)

    replay = sub.add_parser("replay", help="run the learner again on a run's experience and check every digest")
    _log_options(replay)
    replay.add_argument("--out", type=Path, required=True, help="a new folder for the replayed learner")
    replay.add_argument("--from-checkpoint", type=Path, help="a checkpoint folder of the run (default: the start)")
    replay.set_defaults(handler=_replay)

    rescore = sub.add_parser("rescore", help="score a run's responses again with another reward and compare")
    _log_options(rescore)
    rescore.add_argument(
        "--reward-config",
        type=Path,
        required=True,
        help="the new reward: a file of a reward section alone (reward: {function: ...}), or a whole run config",
    )
    rescore.add_argument("--reward-set", action="append", default=[], metavar="KEY=VALUE")
    rescore.add_argument("--out", type=Path, required=True)
    rescore.add_argument("--top", type=int, default=20, help="disagreements listed in report.md")
    rescore.set_defaults(handler=_rescore)
