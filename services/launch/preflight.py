"""What every service of a run would find wrong at its start, found once, before any is started: ``streamppo up``
asks each role of the run what it checks of its inputs (``Service.check_inputs``: the prompt file and that it holds
a batch, the reward function or model, the models' folders, the trackers' libraries), and stops with exit code 2
naming the setting, instead of starting services that would each fail and be restarted.

Each check is the one the service itself makes when it starts (the same loaders), so the two cannot disagree; a
service that finds such an error anyway (its config changed, a file went away) exits 2 too, and ``up`` does not
restart it.
"""

from __future__ import annotations

import socket

from common.config import ConfigError, RunConfig

__all__ = ["check_broker_answers", "check_run_inputs"]

BROKER_ANSWER_S = 3.0  # how long a broker named at the start of a run may take to accept a connection


def check_broker_answers(bootstrap: str, within_s: float = BROKER_ANSWER_S) -> None:
    """Raise :class:`~common.config.ConfigError` when none of the brokers ``bootstrap`` names accepts a connection
    within ``within_s``: a command a user runs against a broker says what to check in seconds, where a service
    (started before its broker, by compose or Kubernetes) waits ``kafka.connect_timeout_s`` for it."""
    failures = []
    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=within_s).close()
            return
        except OSError as exc:
            failures.append(f"{server.strip()}: {exc.strerror or type(exc).__name__}")
    raise ConfigError(
        f"no broker answers at {bootstrap} ({'; '.join(failures)}): check the address (--bootstrap or "
        "kafka.bootstrap), that the broker runs and listens there, and that its advertised listeners name an address "
        "this machine reaches"
    )


def check_run_inputs(config: RunConfig) -> None:
    """Raises :class:`~common.config.ConfigError`, :class:`~common.data.DatasetError`,
    :class:`~common.rewards.RewardError` or :class:`~common.models.ModelLoadError`: the signing key, then what each
    role of the run checks of its inputs (``Service.check_inputs``), in pipeline order; builtin models are built into
    the cache now, once, as the services would."""
    from services.roles import roles_of

    config.signing_key()  # a key named but not there is a ConfigError
    for role in roles_of(config):
        role.service_class().check_inputs(config)
