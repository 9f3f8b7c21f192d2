"""``streamppo archive``: a run's log, from the broker (or the embedded run's bus) into a folder of files
(``common.log_archive``), each referenced batch's file copied beside it, so the log outlives the broker."""

from __future__ import annotations

from pathlib import Path

from common.batch_store import BatchStore, BatchStoreError
from common.log_archive import LogArchiveWriter
from common.schema import BatchReference, SchemaError, decode
from services.ops.runlog.reader import BusReader
from services.roles import LOG_TOPIC, pipeline_topics
from services.transport.base import Bus

__all__ = ["archive_bus", "batch_reference"]


def archive_bus(bus: Bus, dest: Path, run_id: str, partitions: int = 1) -> dict:
    """Write every pipeline topic of ``bus`` to ``dest``; returns the manifest (records per topic, and the
    referenced batches whose files could not be kept, with why)."""
    specs = {spec.name: spec.partitions for spec in pipeline_topics(partitions)}
    reader = BusReader(bus=bus, partitions=specs)
    writer = LogArchiveWriter(dest, run_id, bus.log_identity(LOG_TOPIC))
    missing = []
    for topic, count in specs.items():
        writer.add_topic(topic, count)
        for record in reader.records(topic):
            writer.append(record)
            reference = batch_reference(record.value)
            if reference is not None:
                try:
                    BatchStore.get(reference)  # whole and as digested, or not kept
                    writer.keep_batch_file(Path(reference.uri))
                except BatchStoreError as exc:
                    missing.append(str(exc))
    writer.manifest["missing_batch_files"] = missing
    writer.close()
    return writer.manifest


def batch_reference(value: bytes) -> BatchReference | None:
    """The reference a record's value is, or None for a message sent whole (or bytes that are neither)."""
    try:
        return decode(value, expected=BatchReference)
    except SchemaError:
        return None
