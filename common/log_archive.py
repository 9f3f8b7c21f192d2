"""A run's log as a folder of files, for keeping after the broker is gone: ``streamppo archive`` writes one from a
broker, an embedded run with ``run.archive_log`` writes its own, and every log tool (``trace``, ``export``,
``rescore``, ``replay``) reads one as it reads a broker.

Layout::

    <folder>/manifest.json                          format, run id, log identity, topics: partitions and records
    <folder>/<topic>/<partition>-<first offset>.msgpack   one file per segment of up to SEGMENT_RECORDS records
    <folder>/batches/<file>                         the files of batches that travelled by reference

A segment is a stream of msgpack arrays ``[offset, timestamp, key, value]``, the record exactly as the topic held
it (``value`` is the message's encoding, or a :class:`~common.schema.BatchReference` whose file is copied into
``batches/``). Offsets are the broker's: an archive of a compacted or partly expired topic has gaps, and says so
by its offsets.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack

__all__ = ["ARCHIVE_FORMAT", "SEGMENT_RECORDS", "ArchiveError", "ArchivedRecord", "LogArchive", "LogArchiveWriter"]

ARCHIVE_FORMAT = 1
SEGMENT_RECORDS = 1000
MANIFEST = "manifest.json"
BATCHES = "batches"


class ArchiveError(RuntimeError):
    """A folder that is not a readable log archive."""


@dataclass(frozen=True)
class ArchivedRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp: float


class LogArchiveWriter:
    """Writes records topic by topic, partition by partition, in offset order; :meth:`close` writes the manifest
    last, so a folder without one is an archive cut short."""

    def __init__(self, root: Path, run_id: str, identity: str | None):
        self.root = Path(root)
        if (self.root / MANIFEST).exists():
            raise ArchiveError(f"{self.root} already holds a log archive; archive into a new folder")
        self.root.mkdir(parents=True, exist_ok=True)
        self.manifest = {"format": ARCHIVE_FORMAT, "run_id": run_id, "identity": identity, "topics": {}}
        self._open: tuple[str, int] | None = None
        self._file = None
        self._in_segment = 0

    def add_topic(self, topic: str, partitions: int) -> None:
        self.manifest["topics"].setdefault(topic, {"partitions": partitions, "records": 0})

    def append(self, record: ArchivedRecord) -> None:
        """Add ``record`` (or any record with its fields: a transport ``Record``, as a broker yields it)."""
        if self._open != (record.topic, record.partition) or self._in_segment >= SEGMENT_RECORDS:
            self._close_segment()
            folder = self.root / record.topic
            folder.mkdir(exist_ok=True)
            self._file = open(folder / f"{record.partition}-{record.offset:012d}.msgpack", "wb")
            self._open, self._in_segment = (record.topic, record.partition), 0
        self._file.write(msgpack.packb([record.offset, record.timestamp, record.key, record.value]))
        self._in_segment += 1
        self.manifest["topics"][record.topic]["records"] += 1

    def keep_batch_file(self, path: Path) -> None:
        """Copy a referenced batch's file into the archive (its digest is checked when it is read)."""
        (self.root / BATCHES).mkdir(exist_ok=True)
        shutil.copyfile(path, self.root / BATCHES / Path(path).name)

    def _close_segment(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> Path:
        self._close_segment()
        partial = self.root / (MANIFEST + ".partial")
        partial.write_text(json.dumps(self.manifest, indent=2) + "\n")
        os.replace(partial, self.root / MANIFEST)
        return self.root


class LogArchive:
    """A written archive, read."""

    def __init__(self, root: Path):
        self.root = Path(root)
        try:
            self.manifest = json.loads((self.root / MANIFEST).read_text())
        except FileNotFoundError:
            raise ArchiveError(
                f"{self.root} is no log archive (no {MANIFEST}; an archive whose writing was cut short has none)"
            ) from None
        if self.manifest.get("format") != ARCHIVE_FORMAT:
            raise ArchiveError(f"{self.root}: archive format {self.manifest.get('format')!r}, not {ARCHIVE_FORMAT}")

    @property
    def run_id(self) -> str:
        return self.manifest["run_id"]

    @property
    def identity(self) -> str | None:
        return self.manifest["identity"]

    def topics(self) -> list[str]:
        return list(self.manifest["topics"])

    def records(self, topic: str) -> Iterator[ArchivedRecord]:
        """Every record of ``topic``, partition by partition, each in offset order."""
        if topic not in self.manifest["topics"]:
            raise ArchiveError(f"{self.root} holds no topic {topic!r} (it holds {', '.join(self.topics())})")
        segments = sorted((self.root / topic).glob("*.msgpack"), key=lambda p: tuple(int(x) for x in p.stem.split("-")))
        for path in segments:
            partition = int(path.stem.split("-")[0])
            with open(path, "rb") as fh:
                for offset, timestamp, key, value in msgpack.Unpacker(fh, raw=False, max_buffer_size=2**31 - 1):
                    yield ArchivedRecord(topic, partition, offset, key, value, timestamp)

    def batch_file(self, uri: str) -> Path:
        """Where the archive keeps the file a reference named ``uri``."""
        return self.root / BATCHES / Path(uri).name
