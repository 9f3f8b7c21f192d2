"""Batches too large for a Kafka record: stored in a shared directory, sent as a small reference.

At the 7B profile one experience batch encodes to 84 MB, over the 64 MB a record may have here by default and far
over Apache Kafka's default of 1 MB (``benchmarks/RESULTS.md``, section 9). A batch whose encoded bytes exceed
``pipeline.inline_max_bytes`` is written here (under a temporary name, fsynced, renamed: a reader never sees a
part of it) and travels as a :class:`~common.schema.BatchReference`, as weight snapshots already do. The reader
checks the file's digest before decoding it, so a missing, truncated or altered file is refused like a malformed
record. A file is removed once the group that reads it has committed past its record: by then the batch is in the
next stage's output (every message carries its parent's fields) or, for experience, in the learner's checkpoint.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from common.schema import BatchMessage, BatchReference, Message, encode
from common.storage import fsync_file, write_or_explain
from common.weights import new_hasher

__all__ = ["BatchStore", "BatchStoreError"]

DIGEST = "blake3"


class BatchStoreError(RuntimeError):
    """A referenced batch file that is missing or does not match its digest."""


def _digest(data: bytes | memoryview) -> str:
    hasher = new_hasher(DIGEST)
    hasher.update(data)
    return f"{DIGEST}:{hasher.hexdigest()}"


class BatchStore:
    """One directory shared by every service of a run (``pipeline.batch_store``)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def record_value(self, message: Message, inline_max_bytes: int) -> tuple[bytes, bool]:
        """What a topic carries for ``message``: its encoding or, when that exceeds ``inline_max_bytes``, a reference
        to the file it is put in; and whether it went by reference."""
        payload = encode(message)
        if len(payload) <= inline_max_bytes:
            return payload, False
        return encode(self.put(message, payload)), True

    def put(self, message: Message, payload: bytes) -> BatchReference:
        """Store the encoded ``message`` and return the reference to send in its place."""
        self.root.mkdir(parents=True, exist_ok=True)
        # A name of its own per write: a batch written again (by a replica that died after writing it) gets another
        # file. The batch id comes from a message: only its safe characters reach the file name.
        readable = re.sub(r"[^A-Za-z0-9_.-]", "_", message.batch_id)[:100]
        path = self.root / f"{message.SCHEMA}-{readable}-{uuid.uuid4().hex[:12]}.msgpack"
        partial = path.with_name(path.name + ".partial")

        def write() -> None:
            with open(partial, "wb") as fh:
                fh.write(payload)
            fsync_file(partial)
            os.replace(partial, path)

        write_or_explain(self.root, f"batch {message.batch_id}", len(payload), write, lambda: partial.unlink(True))
        return BatchReference(
            carries=message.SCHEMA,
            batch_id=message.batch_id,
            step=message.step if isinstance(message, BatchMessage) else -1,
            uri=str(path),
            digest=_digest(payload),
            num_bytes=len(payload),
        )

    @staticmethod
    def get(reference: BatchReference) -> bytes:
        """The referenced bytes, checked against the digest; :class:`BatchStoreError` if they cannot be had."""
        try:
            data = Path(reference.uri).read_bytes()
        except OSError as exc:
            raise BatchStoreError(f"batch {reference.batch_id}: cannot read {reference.uri}: {exc.strerror}") from None
        if len(data) != reference.num_bytes or _digest(data) != reference.digest:
            raise BatchStoreError(
                f"batch {reference.batch_id}: {reference.uri} holds {len(data)} bytes that do not match the "
                f"reference ({reference.num_bytes} bytes, {reference.digest})"
            )
        return data

    @staticmethod
    def remove(reference: BatchReference) -> None:
        Path(reference.uri).unlink(missing_ok=True)
