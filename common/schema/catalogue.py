"""The message catalogue: every wire type by schema name, the one each pipeline topic carries, and their published
description (``protos/``)."""

from __future__ import annotations

from common.schema.batches import (
    ExperienceBatch,
    PromptBatch,
    RolloutBatch,
    ScoredBatch,
)
from common.schema.episodes import (
    Completion,
    CompletionRequest,
    EnvironmentReply,
    EpisodeEvent,
    EpisodeTurn,
)
from common.schema.records import (
    BatchReference,
    DeadLetter,
    ReplicaStatus,
    WeightAnnouncement,
)

MESSAGE_TYPES: dict[str, type] = {
    cls.SCHEMA: cls
    for cls in (
        PromptBatch,
        RolloutBatch,
        ScoredBatch,
        ExperienceBatch,
        WeightAnnouncement,
        DeadLetter,
        ReplicaStatus,
        BatchReference,
        EpisodeTurn,
        EnvironmentReply,
        CompletionRequest,
        Completion,
        EpisodeEvent,
    )
}
# The message type each pipeline topic carries. Dead-letter topics are named "<topic>.dlq".
TOPIC_MESSAGE: dict[str, type] = {
    "prompts": PromptBatch,
    "rollouts": RolloutBatch,
    "scored": ScoredBatch,
    "experience": ExperienceBatch,
    "weights": WeightAnnouncement,
    "turns": EpisodeTurn,
    "observations": EnvironmentReply,
    "requests": CompletionRequest,
    "completions": Completion,
    "episodes": EpisodeEvent,
}


def describe(cls: type) -> dict:
    """The published description of a message type, as written in ``protos/<schema>.yaml``."""
    return {
        "schema": cls.SCHEMA,
        "version": cls.VERSION,
        "doc": cls.DOC,
        "fields": {name: wire.describe() for name, wire in cls.wire_fields()},
    }
