"""The wire's building blocks: the dtypes and bounds every message keeps to, the lineage keys the pipeline reads,
and the wire types a message's fields declare (a scalar, an array of symbolic dimensions, a string list, a lineage
map)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Array dtypes allowed on the wire. Little-endian only: '<' is forced on encode and required on decode.
WIRE_DTYPES = ("bool", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
# Bounds that keep a hostile message from costing more than its own size.
MAX_LINEAGE_ENTRIES = 256


# Lineage key naming the run a message belongs to; topics can outlive a run, so consumers check it.
RUN_ID = "run.id"
# Lineage key of a weight announcement: the epoch of the learner that wrote it, which rises at each learner start,
# so a reader can ignore a zombie learner (an older epoch) that still announces.
LEARNER_EPOCH = "learner.epoch"
# Lineage key of a gateway's call to the generators: the learner epoch of the announcement that the gateway admitted
# the call by (its header's policy_version is that announcement's version). A generator answers the call with those
# weights or newer ones: with older ones, its tokens would be too stale for the update the call was admitted to.
ADMITTED_EPOCH = "gateway.admitted_epoch"
# Lineage of an actor announcement whose snapshot holds LoRA adapters: "lora", and the base model they adapt.
ADAPTER = "actor.adapter"
ADAPTER_BASE = "actor.base"
# Lineage key of a weight announcement: the groups the learner has used up (trained, or dropped: stale or without
# signal). Generators admit prompt batches by it (bounded staleness counted in groups).
LEARNER_GROUPS_DONE = "learner.groups_done"
# Lineage key of a weight announcement: the prompt batches before it are settled (each group trained, waiting in the
# learner's checkpoint, or dropped). A feeder on a new log (the broker lost its data) publishes again from it.
LEARNER_SETTLED = "learner.settled"
# Lineage key of a weight announcement: the prompt batches published past the run's own to replace groups dropped as
# too stale (pipeline.stale_reserve), so that the run still makes run.steps updates. The feeder publishes them.
LEARNER_REPLACEMENTS = "learner.replacements"


def group_key(step: int, index: int) -> str:
    """The idempotency key of one group (a prompt's ``n`` responses): the prompt's step and row in its batch. A
    group is trained once however the records that carry it are cut."""
    return f"{step}/{index}"


class SchemaError(ValueError):
    """A message that cannot be decoded or does not satisfy its schema. The text says which field and why."""


# --------------------------------------------------------------------------------------------- wire types


@dataclass(frozen=True)
class Scalar:
    kind: str  # "str" | "int" | "float" | "bool" | "bytes"
    doc: str

    def describe(self) -> dict:
        return {"type": self.kind, "doc": self.doc}


@dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[str, ...]  # symbolic dimension names, e.g. ("N", "T")
    doc: str

    def describe(self) -> dict:
        return {"type": "array", "dtype": self.dtype, "shape": list(self.dims), "doc": self.doc}


@dataclass(frozen=True)
class StringList:
    dim: str
    doc: str

    def describe(self) -> dict:
        return {"type": "list[str]", "shape": [self.dim], "doc": self.doc}


@dataclass(frozen=True)
class Lineage:
    doc: str

    def describe(self) -> dict:
        return {"type": "map[str, str|int|float|bool|null]", "doc": self.doc}


WireType = Scalar | Array | StringList | Lineage


def wire_field(wire_type: WireType):
    return field(metadata={"wire": wire_type})


def scalar(kind: str, doc: str):
    return wire_field(Scalar(kind, doc))


def array(dtype: str, *dims: str, doc: str):
    assert dtype in WIRE_DTYPES, dtype
    return wire_field(Array(dtype, tuple(dims), doc))
