"""What every message is: the header (:class:`Message`), a batch topic's message (:class:`BatchMessage`), a record
without a header (:class:`Record`), and how one message derives from another or an old version upgrades."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from common.schema.wire import (
    Lineage,
    SchemaError,
    WireType,
    scalar,
    wire_field,
)

# --------------------------------------------------------------------------------------------- messages

# (lengths field, padded width dimension) pairs: a length may not exceed the width it measures.
_LENGTHS = (("prompt_lengths", "P"), ("response_lengths", "T"))
_TOKENS = (
    "prompt_tokens",
    "response_tokens",
    "prompt_index",
    "group_index",
    "no_signal_groups",
    "dead_lettered_groups",
)


@dataclass
class Message:
    """The header every pipeline message carries (see ``docs/ARCHITECTURE.md``, "Topics and messages")."""

    SCHEMA: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
    # Older versions this build still reads: version -> a function from its raw map to the current version's.
    UPGRADES: ClassVar[dict] = {}
    DOC: ClassVar[str] = ""

    batch_id: str = scalar("str", "Stable id of the prompt batch this message descends from; the idempotency key.")
    producer: str = scalar("str", "Id of the service replica that produced this message.")
    policy_version: int = scalar(
        "int", "Actor policy version that sampled the rollouts (weights: the version announced)."
    )
    created_at: float = scalar("float", "Unix time at which this message was produced.")
    lineage: dict = wire_field(
        Lineage(
            "Everything needed to re-train from this message: sampling parameters, model ids and versions, "
            "coefficients."
        )
    )

    @classmethod
    def wire_fields(cls) -> list[tuple[str, WireType]]:
        return [(f.name, f.metadata["wire"]) for f in dataclasses.fields(cls)]

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        """Checks across fields, beyond each field's wire type (lengths within widths, ids not negative); raises
        :class:`SchemaError`. ``values`` are the decoded fields, ``dims`` the sizes of the symbolic dimensions."""
        for name, dim in _LENGTHS:
            if name in values:
                lengths = values[name]
                if lengths.size and (lengths.min() < 0 or lengths.max() > dims[dim]):
                    raise SchemaError(f"{cls.SCHEMA}: {name} must lie in [0, {dim}={dims[dim]}]")
        for name in _TOKENS:
            if name in values and values[name].size and values[name].min() < 0:
                raise SchemaError(f"{cls.SCHEMA}: {name} holds negative ids")


@dataclass
class BatchMessage(Message):
    """A message of the pipeline's batch topics: it descends from one prompt batch, whose step it carries."""

    step: int = scalar(
        "int",
        "Sequence number of the prompt batch in the feeder's stream (0, 1, 2, ...); gates bounded staleness and "
        "picks the partition (step mod partitions).",
    )

    @property
    def rows(self) -> int:
        """Sequences in the batch: prompts, or responses downstream of the generator."""
        raise NotImplementedError

    def idempotency_keys(self) -> list[str]:
        """What a consumer remembers having handled: the batch id, or (past the generator) each group's key."""
        return [self.batch_id]

    @property
    def response_tokens_total(self) -> int:
        """Real response tokens in the batch (0 before the generator)."""
        return 0


def new_header(batch_id: str, producer: str, policy_version: int, lineage: dict | None = None) -> dict:
    """Header keyword arguments for a new message."""
    return {
        "batch_id": batch_id,
        "producer": producer,
        "policy_version": int(policy_version),
        "created_at": time.time(),
        "lineage": dict(lineage or {}),
    }


def chain_upgrades(*upgrades):
    """One upgrade that applies ``upgrades`` in order (each from one version's raw map to the next's)."""

    def upgrade(raw: dict) -> dict:
        for step in upgrades:
            raw = step(raw)
        return raw

    return upgrade


class WireRecord:
    """A wire type outside the pipeline (no header): its wire fields are all its fields."""

    UPGRADES: ClassVar[dict] = {}

    @classmethod
    def wire_fields(cls) -> list[tuple[str, WireType]]:
        return [(f.name, f.metadata["wire"]) for f in dataclasses.fields(cls)]

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        """No checks across fields."""


def derive(parent: Message, cls: type, producer: str, lineage: dict | None = None, **fields: Any) -> Message:
    """A message of type ``cls`` that extends ``parent`` (a base class of ``cls``) with ``fields``.

    Header and parent fields are carried over; ``producer`` and ``created_at`` are renewed and ``lineage`` is
    merged into the parent's, so every stage adds what it contributed.
    """
    carried = {f.name: getattr(parent, f.name) for f in dataclasses.fields(parent)}
    carried.update(producer=producer, created_at=time.time(), lineage={**parent.lineage, **(lineage or {})})
    return cls(**carried, **fields)
