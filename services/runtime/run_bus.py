"""The run's bus: the Kafka bus a config describes, in the run's namespace, with the run's topics.

Kept apart from the services' process code so that a command that only reads the bus (``streamppo status``,
``topics``) loads no model library; here, not in ``transport/``, which knows nothing of a run (its config, its roles
and topics).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from common.config import ConfigError, KafkaSection, RunConfig, load_config
from services.roles import LOG_TOPIC, pipeline_topics
from services.transport.kafka import KafkaBus, KafkaSettings
from services.transport.namespaced import NamespacedBus

__all__ = ["RUN_BROKER", "RUN_CONFIG", "bootstrap_of", "kafka_bus", "kafka_settings", "run_of"]

RUN_BROKER = "broker"  # <run.dir>/broker: the address of the broker `streamppo up` runs the run on
RUN_CONFIG = "config.json"  # <run.dir>/config.json: the run's settings as given (what load_config takes back)


def kafka_bus(
    config: RunConfig, bootstrap: str | None = None, replace_wrong_topics: bool = False, make: bool = True
) -> NamespacedBus:
    """The Kafka bus the config describes, in the run's namespace (``kafka.namespace``, by default the run id), with
    every pipeline topic created (unless ``make`` is False: a reader such as ``streamppo status`` makes no log).

    A weights topic that is not what the pipeline needs (a new broker made it with its defaults) is refused
    (``TopicMismatch``), or with ``replace_wrong_topics`` (``streamppo topics``, ``streamppo up``) replaced.
    """
    k = config.kafka
    kafka = KafkaBus(kafka_settings(k, bootstrap_of(config, bootstrap)))
    bus = NamespacedBus(kafka, config.namespace)
    if not make:
        return bus
    bus.create_topics(pipeline_topics(k.partitions, k.retention), replace_wrong=replace_wrong_topics)
    bus.log_identity(LOG_TOPIC, create=True)  # the topics and their identity are the run's log
    return bus


def kafka_settings(section: KafkaSection, bootstrap: str) -> KafkaSettings:
    """The Kafka client's settings from the config's section: every setting of both by its name, so the config's
    defaults are the ones that hold (the transport's own serve those who use it alone: benchmarks, tests)."""
    shared = ({f.name for f in dataclasses.fields(KafkaSettings)} & set(KafkaSection.model_fields)) - {"bootstrap"}
    return KafkaSettings(
        bootstrap=bootstrap, security=section.client_options(), **{name: getattr(section, name) for name in shared}
    )


def bootstrap_of(config: RunConfig, given: str | None) -> str:
    """The broker list to use (``--bootstrap``, else ``kafka.bootstrap``), checked for its form."""
    bootstrap = given or config.kafka.bootstrap
    if not bootstrap:
        raise ConfigError("no Kafka broker given: pass --bootstrap HOST:PORT or set kafka.bootstrap")
    for server in bootstrap.split(","):
        host, sep, port = server.strip().rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"bootstrap {bootstrap!r}: expected HOST:PORT, or several separated by commas")
    return bootstrap


def run_of(
    config_path: Path | None, overrides: list[str], run_dir: Path | None, bootstrap: str | None
) -> tuple[RunConfig, str | None]:
    """The run a command that reads it names, and its broker: by ``--config`` (and ``--bootstrap`` or
    ``kafka.bootstrap``), or by ``--run-dir`` alone: the settings and the broker's address ``streamppo up`` wrote
    there (a local broker's port is a new one at each ``up``)."""
    if config_path is None and run_dir is None:
        raise ConfigError("name the run: --config FILE (and --bootstrap), or --run-dir DIR of a run `streamppo up` ran")
    if config_path is None:
        saved = Path(run_dir) / RUN_CONFIG
        if not saved.is_file():
            raise ConfigError(f"{run_dir} holds no {RUN_CONFIG}: is it the run directory of a run `streamppo up` ran?")
        config_path = saved
    config = load_config(config_path, overrides)
    broker = Path(run_dir or config.run.dir) / RUN_BROKER
    if bootstrap is None and broker.is_file() and (run_dir is not None or not config.kafka.bootstrap):
        bootstrap = broker.read_text().strip()
    return config, bootstrap
