"""The pipeline's roles: the one list of them, and the topics they use.

Everything that starts services reads :data:`ROLES`: the CLI (one command per role), ``streamppo up`` (one process
per replica), the embedded run (one service per role), the process runner, and :func:`pipeline_topics`. Adding a
role is one entry here plus its service class; see ``docs/ARCHITECTURE.md`` for the pipeline they form.

Service classes are named as ``"module:Class"`` and imported on first use, so that ``streamppo --help`` or
``streamppo up`` does not import torch, transformers or vLLM.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from common.config import RetentionSection, RunConfig
from common.schema import TOPIC_MESSAGE
from services.transport.base import TopicSpec, dlq_topic

__all__ = [
    "COMPACTED_TOPICS",
    "LOG_TOPIC",
    "ROLES",
    "STATUS_TOPIC",
    "WEIGHTS_TOPIC",
    "Role",
    "pipeline_topics",
    "roles_of",
]

# Weight announcements: read by every replica that loads weights (no consumer group), compacted by key.
WEIGHTS_TOPIC = "weights"
# Each replica's latest ReplicaStatus (common.schema), compacted by replica id: what `streamppo status` reads.
STATUS_TOPIC = "status"
# The log's identity: its first record, written when the run's topics are made (Bus.log_identity). A broker that
# lost its data has no such topic; topics made again hold another identity. Either way a service that worked on the
# old log stops (LogReplaced).
LOG_TOPIC = "log-identity"
# The topics kept by key (cleanup.policy=compact): a record with a null value there is a tombstone, Kafka's deletion
# of its key's record, not a malformed message.
COMPACTED_TOPICS = frozenset({WEIGHTS_TOPIC, STATUS_TOPIC, LOG_TOPIC})


@dataclass(frozen=True)
class Role:
    name: str
    service: str  # "module:Class", a subclass of services.service.Service
    summary: str  # one line for `streamppo --help`
    input_topic: str | None  # None: the role consumes nothing (the feeder)
    output_topic: str | None  # None: the role writes nothing on the bus (the evaluator)
    # (input, output) in a run where the role answers another role's channel instead, None where it does not (the
    # generator answers the gateway's calls in a gateway run).
    serves_channel: Callable[[RunConfig], tuple[str, str] | None] = lambda config: None
    weight_models: tuple[str, ...] = ()  # models whose announcements on WEIGHTS_TOPIC its replicas load
    max_replicas: int | None = None  # None: as many as the user starts
    ends_run: bool = False  # the run is over when every replica of such a role is done
    aliases: tuple[str, ...] = ()  # other names of its CLI command
    # Whether a run of this config has the role (every run but for optional roles, e.g. environments).
    runs_when: Callable[[RunConfig], bool] = lambda config: True
    requirement: str = ""  # what runs_when asks of the config, in words, for the error when it is not met

    def topics(self, config: RunConfig) -> tuple[str | None, str | None]:
        """``(input, output)``: the role's topics in a run of ``config``."""
        return self.serves_channel(config) or (self.input_topic, self.output_topic)

    def service_class(self) -> type:
        """The :class:`services.service.Service` subclass that implements the role (imported now)."""
        module, _, name = self.service.partition(":")
        return getattr(importlib.import_module(module), name)

    def create(self, config: RunConfig, replica_id: str | None = None):
        """A replica of the role: ``Service(config, replica_id)``."""
        return self.service_class()(config, replica_id)


ROLES: dict[str, Role] = {
    role.name: role
    for role in (
        Role(
            "feeder",
            "services.feeder:FeederService",
            "publish the run's prompt batches (again on a new log) until the learner has settled them",
            input_topic=None,
            output_topic="prompts",
            max_replicas=1,
            aliases=("feed",),
        ),
        Role(
            "generator",
            "services.generator:GeneratorService",
            "prompts → rollouts: the actor samples n responses per prompt, with their log-probs",
            input_topic="prompts",
            output_topic="rollouts",
            weight_models=("actor",),
            serves_channel=lambda config: ("requests", "completions") if config.gateway is not None else None,
        ),
        Role(
            "gateway",
            "services.gateway:GatewayService",
            "prompts → rollouts: agents run the episodes through an OpenAI-compatible API; the generators sample",
            input_topic="prompts",
            output_topic="rollouts",
            weight_models=("actor",),
            runs_when=lambda config: config.gateway is not None,
            requirement="a gateway section",
        ),
        Role(
            "scorer",
            "services.scorer:ScorerService",
            "rollouts → scored: reward model scores and the frozen reference's log-probs",
            input_topic="rollouts",
            output_topic="scored",
        ),
        Role(
            "advantage",
            "services.advantage:AdvantageService",
            "scored → experience: critic values, KL-shaped rewards, advantages",
            input_topic="scored",
            output_topic="experience",
            weight_models=("critic",),
        ),
        Role(
            "learner",
            "services.learner:LearnerService",
            "experience → weights: PPO updates of actor and critic, snapshots announced",
            input_topic="experience",
            output_topic=WEIGHTS_TOPIC,
            max_replicas=1,
            ends_run=True,
        ),
        Role(
            "environment",
            "services.environment:EnvironmentService",
            "turns → observations: environments answer the model's turns of multi-turn episodes (tools)",
            input_topic="turns",
            output_topic="observations",
            runs_when=lambda config: config.environment is not None and config.environment.placement == "bus",
            requirement="an environment section with placement: bus",
        ),
        Role(
            "evaluator",
            "services.evaluator:EvaluatorService",
            "weights → eval.jsonl: held-out prompts scored with the run's reward every eval.every versions",
            input_topic=None,
            output_topic=None,
            weight_models=("actor",),
            max_replicas=1,
            ends_run=True,  # the run's last version is evaluated before the run is over
            runs_when=lambda config: config.eval is not None,
            requirement="an eval section",
        ),
    )
}


def roles_of(config: RunConfig) -> list[Role]:
    """The roles a run of ``config`` has, in pipeline order."""
    return [role for role in ROLES.values() if role.runs_when(config)]


def pipeline_topics(partitions: int = 1, retention: RetentionSection | None = None) -> list[TopicSpec]:
    """Every topic the pipeline uses (those of ``common.schema.TOPIC_MESSAGE``), each with its dead-letter topic,
    and the status topic; the data topics and dead letters kept as ``retention`` says (else the broker's default).

    The weights and status topics have one partition and are compacted: their readers want the newest record per
    model, per replica.
    """

    def kept(topic: str) -> dict:
        if retention is None:
            return {}
        hours, size = retention.of(topic)
        return {"retention_ms": -1 if hours is None else round(hours * 3_600_000), "retention_bytes": size}

    specs = []
    for name in TOPIC_MESSAGE:
        weights = name == WEIGHTS_TOPIC
        specs.append(
            TopicSpec(
                name, 1 if weights else partitions, compacted=weights, verify=weights, **({} if weights else kept(name))
            )
        )
        specs.append(TopicSpec(dlq_topic(name), 1, **kept(name)))
    specs.append(TopicSpec(STATUS_TOPIC, 1, compacted=True))
    specs.append(TopicSpec(LOG_TOPIC, 1, compacted=True))
    return specs
