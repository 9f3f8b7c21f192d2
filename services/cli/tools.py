"""The tools' commands: ``models``, ``train-rm``, ``report``, ``protos`` and ``config-reference``."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from services.cli.options import first_sentence


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
            print(f"builtin:{name:<24} {first_sentence(build.__doc__ or '')}")
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
            "# Generated from common/schema/ by `streamppo protos --write`; "
            "tests/common/test_schema.py holds the codec to it.\n"
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


def add_tool_commands(sub) -> None:
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
