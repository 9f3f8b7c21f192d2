"""``streamppo``: the parser of every command, logging as the commands want it, and the one place an error a user can
fix becomes a line on stderr and an exit code."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from services.cli.options import SETTINGS_VARIABLE
from services.cli.pipeline import add_pipeline_commands
from services.cli.tools import add_tool_commands
from services.ops.runlog.commands import add_log_commands
from services.runtime import exit_codes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamppo", description="RLHF-PPO as services over a message bus.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    add_pipeline_commands(sub)
    add_tool_commands(sub)
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "set"):
        # Settings for every command of a deployment (one compose override for all its services); --set wins.
        args.set = [*os.environ.get(SETTINGS_VARIABLE, "").split(), *args.set]
    _configure_logging(args.verbose)
    return _dispatch(args)
