"""The wire contract: one message type per topic, and the msgpack codec that carries them.

Every message is a msgpack map. Arrays travel as ``{"dtype": str, "shape": [int, ...], "data": bytes}`` with
little-endian data. Nothing is pickled. Each field's wire type is declared once, in the dataclass field's
metadata, and that declaration drives encoding, validation on decode, and the published description in
``protos/`` (kept equal to it by ``tests/common/test_schema.py``).

Decoding untrusted bytes either returns a fully validated message or raises :class:`SchemaError`: declared sizes
are checked against the bytes actually present before anything is allocated, and symbolic dimensions (``N``,
``T``...) must agree across all arrays of a message.

The package: :mod:`.wire` (dtypes, lineage keys, wire types), :mod:`.base` (the header, how messages derive and
upgrade), the messages (:mod:`.batches`, :mod:`.episodes`, :mod:`.records`), :mod:`.catalogue` (by schema and by
topic, and the published description) and :mod:`.codec`.
"""

from common.schema.base import BatchMessage, Message, derive, new_header
from common.schema.batches import ExperienceBatch, PromptBatch, RolloutBatch, ScoredBatch
from common.schema.catalogue import MESSAGE_TYPES, TOPIC_MESSAGE, describe
from common.schema.codec import decode, encode, message_key, message_partition
from common.schema.episodes import (
    Completion,
    CompletionRequest,
    EnvironmentReply,
    EpisodeEvent,
    EpisodeTurn,
    episode_key,
)
from common.schema.records import (
    REPORT_EVERY_S,
    BatchReference,
    DeadLetter,
    ReplicaStatus,
    WeightAnnouncement,
    chain_link,
    split_link,
)
from common.schema.wire import (
    ADAPTER,
    ADAPTER_BASE,
    ADMITTED_EPOCH,
    LEARNER_EPOCH,
    LEARNER_GROUPS_DONE,
    LEARNER_REPLACEMENTS,
    LEARNER_SETTLED,
    RUN_ID,
    SchemaError,
    group_key,
)

__all__ = [
    "ADAPTER",
    "ADAPTER_BASE",
    "ADMITTED_EPOCH",
    "BatchMessage",
    "BatchReference",
    "Completion",
    "CompletionRequest",
    "DeadLetter",
    "EnvironmentReply",
    "EpisodeEvent",
    "EpisodeTurn",
    "ExperienceBatch",
    "LEARNER_EPOCH",
    "LEARNER_GROUPS_DONE",
    "LEARNER_REPLACEMENTS",
    "LEARNER_SETTLED",
    "MESSAGE_TYPES",
    "Message",
    "PromptBatch",
    "REPORT_EVERY_S",
    "RUN_ID",
    "ReplicaStatus",
    "RolloutBatch",
    "SchemaError",
    "ScoredBatch",
    "TOPIC_MESSAGE",
    "WeightAnnouncement",
    "chain_link",
    "decode",
    "derive",
    "describe",
    "encode",
    "episode_key",
    "group_key",
    "message_key",
    "message_partition",
    "new_header",
    "split_link",
]
