"""The messages beside the batches: the learner's weight announcements, and records without a header (dead
letters, replica status, a reference to a batch too large for a record)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.schema.base import Message, WireRecord
from common.schema.wire import (
    LEARNER_EPOCH,
    Lineage,
    SchemaError,
    StringList,
    scalar,
    wire_field,
)


def chain_link(digest: str, uri: str) -> str:
    """One entry of a weight announcement's ``chain``: ``"<digest> <uri>"`` (a digest has no space; a uri may)."""
    return f"{digest} {uri}"


def split_link(link: str) -> tuple[str, str]:
    """``(digest, uri)`` of a ``chain`` entry."""
    digest, _, uri = link.partition(" ")
    return digest, uri


def _weights_v1_to_v3(raw: dict) -> dict:
    """Version 1 named its digest ``sha256`` (hex): it reads as a ``sha256:`` digest, a chain of that one file."""
    if not isinstance(raw.get("sha256"), str):
        return raw  # validation names what is wrong
    digest = f"sha256:{raw['sha256']}"
    return _weights_v2_to_v3(
        {k: v for k, v in raw.items() if k != "sha256"}
        | {"digest": digest, "chain": [chain_link(digest, raw.get("uri"))]}
    )


def _weights_v2_to_v3(raw: dict) -> dict:
    """Version 2 had no broadcast path: nothing was broadcast."""
    return raw | {"broadcast_digest": ""}


@dataclass
class WeightAnnouncement(Message):
    SCHEMA: ClassVar[str] = "weights"
    DOC: ClassVar[str] = (
        "A weight snapshot in the weight store. Keyed by model on a compacted topic, so the latest one per model "
        "survives; policy_version is the version the snapshot holds."
    )

    VERSION: ClassVar[int] = 3
    UPGRADES: ClassVar[dict] = {1: _weights_v1_to_v3, 2: _weights_v2_to_v3}

    model: str = scalar("str", "Which model: 'actor' or 'critic'.")
    uri: str = scalar("str", "Where the safetensors snapshot lies (a path in the shared weight store, or a URL).")
    digest: str = scalar(
        "str", "'<algorithm>:<hex>' of the snapshot file's bytes, blake3 or sha256; a mismatch rejects the snapshot."
    )
    chain: list = wire_field(
        StringList(
            "L",
            "The files to read, in order, each '<digest> <uri>': the newest full snapshot, then the deltas up to "
            "this one (its last entry is this digest and uri). One entry when the snapshot is full.",
        )
    )
    num_bytes: int = scalar("int", "Size of the snapshot file in bytes.")
    broadcast_digest: str = scalar(
        "str",
        "'<algorithm>:<hex>' of the tensors the learner also broadcast for this version (manifest, then each "
        "tensor's bytes), sent only when every receiver held exactly that; '' when nothing was broadcast. A "
        "generator that holds it loads it instead of the snapshot.",
    )

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        if not values["chain"] or values["chain"][-1] != chain_link(values["digest"], values["uri"]):
            raise SchemaError("weights: the chain must end with this snapshot's '<digest> <uri>'")

    @property
    def learner_epoch(self) -> int:
        """The epoch of the learner that announced it (:data:`LEARNER_EPOCH`; 0 before epochs existed)."""
        return int(self.lineage.get(LEARNER_EPOCH, 0))


@dataclass
class DeadLetter(WireRecord):
    """Not a pipeline message: what a service writes to ``<topic>.dlq`` for input it could not decode."""

    SCHEMA: ClassVar[str] = "dead_letter"
    VERSION: ClassVar[int] = 1
    DOC: ClassVar[str] = "A message that failed to decode or validate, with the error and where it came from."

    error: str = scalar("str", "Why the message was rejected.")
    source_topic: str = scalar("str", "Topic the message was read from.")
    source_partition: int = scalar("int", "Partition it was read from.")
    source_offset: int = scalar("int", "Its offset there.")
    payload: bytes = scalar(
        "bytes",
        "The original bytes, untouched; empty for a null value, and cut where the record would not fit beside the "
        "other fields (the error then gives the whole size and digest).",
    )
    producer: str = scalar("str", "The service replica that rejected it.")
    created_at: float = scalar("float", "Unix time of the rejection.")


# How far apart a replica's reports on the status topic are at most while its loop runs (and one when it stops): a
# report older than twice this says the replica is silent (stopped, gone, or in one batch of minutes of compute).
REPORT_EVERY_S = 30.0


@dataclass
class ReplicaStatus(WireRecord):
    """Not a pipeline message: what each service replica says about itself, every 30 s, on the status topic."""

    SCHEMA: ClassVar[str] = "replica_status"
    VERSION: ClassVar[int] = 2
    UPGRADES: ClassVar[dict] = {1: lambda raw: {"url": ""} | raw}  # version 1 had no url: it served none
    DOC: ClassVar[str] = (
        "A service replica's state, keyed by replica on a compacted topic, so the latest one per replica survives: "
        "what `streamppo status` shows."
    )

    replica: str = scalar("str", "The replica's id.")
    role: str = scalar("str", "Its role.")
    run_id: str = scalar("str", "The run it serves.")
    state: str = scalar("str", "'serving', 'waiting' (it holds input it is not ready for), 'done' or 'stopped'.")
    waiting_for: str = scalar("str", "What held input waits for, with its partition and for how long; '' if none.")
    held: int = scalar("int", "Input records held back.")
    held_seconds: float = scalar("float", "How long the oldest held record has waited.")
    lag: int = scalar("int", "Records in its partitions not yet consumed.")
    counters: dict = wire_field(
        Lineage(
            "Batches by outcome (processed, dropped, duplicates, dead_letters, ...), response tokens (tokens), "
            "the weight versions loaded (weights.<model>), and from a fleet's replica the run's share of it (fleet.*)."
        )
    )
    created_at: float = scalar("float", "Unix time of this report.")
    url: str = scalar("str", "Where the replica serves clients over HTTP (the gateway's OpenAI API); '' if nowhere.")


@dataclass
class BatchReference(WireRecord):
    """Not a batch: where a batch too large for a record lies (``common/batch_store.py``), sent in its place."""

    SCHEMA: ClassVar[str] = "batch_reference"
    VERSION: ClassVar[int] = 1
    DOC: ClassVar[str] = (
        "Sent on a batch topic in place of a batch whose encoded bytes exceed pipeline.inline_max_bytes: the batch "
        "is a file in the run's shared batch store. A reader fetches it, checks its digest and decodes it as the "
        "message the topic carries."
    )

    carries: str = scalar("str", "The schema of the message in the file: the one the topic carries.")
    batch_id: str = scalar("str", "The batch id of that message.")
    step: int = scalar("int", "Its step (-1 for a message without one).")
    uri: str = scalar("str", "Where the file lies (a path in the shared batch store).")
    digest: str = scalar("str", "'blake3:<hex>' of the file's bytes; a mismatch dead-letters the record.")
    num_bytes: int = scalar("int", "Size of the file in bytes.")
