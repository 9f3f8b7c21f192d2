"""The ``streamppo`` command: :mod:`.main` (the parser, logging, errors), :mod:`.pipeline` (the run and its roles),
:mod:`.tools` (models, reports, the generated contract) and :mod:`.options` (what several commands share); the log's
commands live with the log (:mod:`services.ops.runlog.commands`)."""

from services.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
