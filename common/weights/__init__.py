"""The weight store: versioned safetensors snapshots with a digest, in a shared directory.

The learner saves a snapshot and announces ``{model, version, uri, digest}``; generator and advantage replicas load
it. A snapshot is written to a temporary name and renamed, so a reader never sees a half-written file under its
final name; a file that was truncated or corrupted anyway fails its digest and is rejected with
:class:`WeightIntegrityError`, leaving the model untouched.

The data is gone over once on each side. The writer digests the tensors it hands to safetensors, in the file's
order, behind the header it reads back: never a second pass over the file. The reader digests the file through a
memory map, and the tensors it loads are views of the same pages: no copy between the file and the model. A digest
is ``<algorithm>:<hex>``: ``blake3`` (multi-threaded, several times faster: ``benchmarks/RESULTS.md``, section 5)
by default, ``sha256`` where a standard hash is required; both are always readable.

Snapshots are not fsynced. One lost in a crash is written again by the learner, which announces its checkpointed
weights at every start, and a torn one fails its digest; the fsync would cost more than the write
(``benchmarks/RESULTS.md``, section 5). Checkpoints, which nothing can rebuild, are fsynced.

:mod:`.store` writes, :mod:`.reading` opens, verifies and loads.
"""

from common.weights.reading import (
    check_fits,
    load_snapshot_into,
    load_state_into,
    open_snapshot,
    open_weights,
    snapshot_shapes,
)
from common.weights.store import (
    DIGEST_ALGORITHMS,
    Snapshot,
    WeightIntegrityError,
    WeightStore,
    delta_state,
    first_names,
    is_adapted,
    new_hasher,
    part_name,
    plan_parts,
    published_tensors,
    snapshot_state,
    tensor_bytes,
    write_part,
)

__all__ = [
    "DIGEST_ALGORITHMS",
    "Snapshot",
    "WeightIntegrityError",
    "WeightStore",
    "check_fits",
    "delta_state",
    "first_names",
    "is_adapted",
    "load_snapshot_into",
    "load_state_into",
    "new_hasher",
    "open_snapshot",
    "open_weights",
    "part_name",
    "plan_parts",
    "published_tensors",
    "snapshot_shapes",
    "snapshot_state",
    "tensor_bytes",
    "write_part",
]
