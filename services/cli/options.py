"""The options several commands share: a run's config (and its broker), and where metrics are served."""

from __future__ import annotations

import argparse
from pathlib import Path

SETTINGS_VARIABLE = "STREAMPPO_SET"  # settings for every command of a deployment; --set wins


def config_options(parser: argparse.ArgumentParser, broker: bool = False, required: bool = True) -> None:
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


def metrics_options(parser) -> None:
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


def first_sentence(doc: str) -> str:
    """A docstring's first sentence as plain text (Sphinx roles and literals unwrapped)."""
    import re

    text = " ".join(doc.split())
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text).replace("``", "")
    end = re.search(r"\.(\s|$)", text)
    return text[: end.start() + 1] if end else text
