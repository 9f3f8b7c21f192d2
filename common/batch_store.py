"""Batches too large for a Kafka record: stored in a shared directory, sent as a small reference.

At the 7B profile one experience batch encodes to 84 MB, over the 64 MB a record may have here by default and far
over Apache Kafka's default of 1 MB (``benchmarks/RESULTS.md``, section 9). A batch whose encoded bytes exceed
``pipeline.inline_max_bytes`` is written here (under a temporary name, fsynced, renamed: a reader never sees a
part of it) and travels as a :class:`~common.schema.BatchReference`, as weight snapshots already do. The reader
checks the file's digest before decoding it, so a missing, truncated or altered file is refused like a malformed
record. Once the group that reads it has committed past its record, the batch is in the
next stage's output (every message carries its parent's fields) or, for experience, in the learner's checkpoint.
A file lives as long as its record: files older than their topic's retention (``kafka.retention``) are removed when
the next batch of that topic is stored, as are the oldest beyond its size budget. With
``kafka.retention.remove_committed_batches`` a file goes as soon as its reader commits past its record instead.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable
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

    def __init__(self, root: Path, retention: Callable[[str], tuple[float | None, int | None]] | None = None):
        """``retention``: a topic's ``(seconds, bytes)`` its files are kept for (None: no limit); None: kept."""
        self.root = Path(root)
        self.retention = retention

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
        self.expire(message.SCHEMA)
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

    def expire(self, topic: str, now: float | None = None) -> list[Path]:
        """Remove the files of ``topic`` past its retention: older than its seconds, then the oldest while the rest
        exceed its bytes. Returns what was removed."""
        if self.retention is None:
            return []
        max_age_s, max_bytes = self.retention(topic)
        if max_age_s is None and max_bytes is None:
            return []
        now = time.time() if now is None else now
        files = []
        for path in self.root.glob(f"{topic}-*.msgpack"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another replica expired it first
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        files.sort()
        removed, total = [], sum(size for _, size, _ in files)
        for mtime, size, path in files:
            too_old = max_age_s is not None and now - mtime > max_age_s
            too_big = max_bytes is not None and total > max_bytes
            if not (too_old or too_big):
                break
            path.unlink(missing_ok=True)
            removed.append(path)
            total -= size
        return removed

    @staticmethod
    def remove(reference: BatchReference) -> None:
        Path(reference.uri).unlink(missing_ok=True)
