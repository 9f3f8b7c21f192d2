"""Typed run configuration, validated at start-up.

A run is described by one YAML file; ``--set section.key=value`` overrides any entry. Unknown keys and bad values
are errors that name the field (``learner.actor_lr: Input should be greater than 0``), raised as
:class:`ConfigError` before any model is loaded.

The package, in the order a run config is read: :mod:`.base` (what a section is), the sections by what they
configure (:mod:`.sampling`, :mod:`.episodes`, :mod:`.training`, :mod:`.delivery`), :mod:`.run` (the config whole,
its checks across sections and the counts derived from them), :mod:`.loading` (YAML and overrides) and
:mod:`.reference` (the Markdown reference generated from the declarations).
"""

from common.config.base import ConfigError, Section
from common.config.delivery import (
    BroadcastSection,
    KafkaSection,
    PipelineSection,
    RetentionSection,
    TopicRetention,
    WeightsSection,
)
from common.config.episodes import AgentSection, EnvironmentSection, GatewaySection, OpenEnvSection, SandboxSection
from common.config.loading import load_config
from common.config.reference import reference
from common.config.run import RunConfig, RunSection, TrackingOptions
from common.config.sampling import (
    DataSection,
    GenerationSection,
    JudgeSection,
    LoraOptions,
    ModelDtypes,
    ModelSection,
    RewardSection,
    VllmOptions,
)
from common.config.training import AdaptiveKL, AlgorithmSection, EvalSection, LearnerSection, OffPolicy, ParallelOptions

__all__ = [
    "AdaptiveKL",
    "AgentSection",
    "AlgorithmSection",
    "BroadcastSection",
    "ConfigError",
    "DataSection",
    "EnvironmentSection",
    "EvalSection",
    "GatewaySection",
    "GenerationSection",
    "JudgeSection",
    "KafkaSection",
    "LearnerSection",
    "LoraOptions",
    "ModelDtypes",
    "ModelSection",
    "OffPolicy",
    "OpenEnvSection",
    "ParallelOptions",
    "PipelineSection",
    "RetentionSection",
    "RewardSection",
    "RunConfig",
    "RunSection",
    "SandboxSection",
    "Section",
    "TopicRetention",
    "TrackingOptions",
    "VllmOptions",
    "WeightsSection",
    "load_config",
    "reference",
]
