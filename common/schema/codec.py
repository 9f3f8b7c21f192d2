"""The msgpack codec: a message to bytes, and untrusted bytes back to a fully validated message or
:class:`~common.schema.wire.SchemaError`; and where a message goes (its partition and key)."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from common.schema.base import BatchMessage, Message
from common.schema.catalogue import MESSAGE_TYPES
from common.schema.records import (
    WeightAnnouncement,
)
from common.schema.wire import (
    MAX_LINEAGE_ENTRIES,
    Array,
    Lineage,
    SchemaError,
    StringList,
    WireType,
)


def message_partition(message: Message, partitions: int) -> int | None:
    """The partition of a batch message: its step modulo the topic's partitions, so consecutive steps land on
    consecutive partitions and each of a role's replicas (which own partitions) gets every R-th step. ``None``
    (partition by key) for messages without a step.

    Hashing batch ids spreads batches unevenly: 32 batches over 8 partitions give the busiest partition about twice
    the mean, and the replica that owns it sets the role's pace (``benchmarks/RESULTS.md``, the simulated cluster).
    A batch's step never changes, so every message of one batch still goes to one partition.
    """
    return message.step % partitions if isinstance(message, BatchMessage) else None


def message_key(message: Message) -> bytes:
    """The partitioning key: the model for weight announcements (so compaction keeps the latest per model),
    the batch id for everything else (so one batch's messages stay in one partition)."""
    if isinstance(message, WeightAnnouncement):
        return message.model.encode()
    return message.batch_id.encode()


# --------------------------------------------------------------------------------------------- encode


def _encode_array(name: str, spec: Array, value: Any) -> dict:
    arr = np.asarray(value)
    if spec.dtype == "bfloat16":
        raise SchemaError(f"{name}: bfloat16 arrays must be sent as float32")  # numpy has no native bfloat16
    arr = np.ascontiguousarray(arr, dtype=np.dtype(spec.dtype).newbyteorder("<"))
    if arr.ndim != len(spec.dims):
        raise SchemaError(f"{name}: expected rank {len(spec.dims)} {spec.dims}, got shape {arr.shape}")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise SchemaError(f"{name}: contains NaN or infinity")
    return {"dtype": spec.dtype, "shape": list(arr.shape), "data": arr.tobytes()}


def encode(message: Any) -> bytes:
    """Encode a message to msgpack bytes. Raises :class:`SchemaError` if a field does not fit its wire type."""
    cls = type(message)
    if MESSAGE_TYPES.get(getattr(cls, "SCHEMA", None)) is not cls:
        raise SchemaError(f"not a wire message type: {cls.__name__}")
    out: dict[str, Any] = {"schema": cls.SCHEMA, "version": cls.VERSION}
    dims: dict[str, int] = {}
    # Validate on the producer's side too, so a bug fails where it is made and not in a consumer's DLQ.
    for name, wire in cls.wire_fields():
        value = getattr(message, name)
        if isinstance(wire, Array):
            out[name] = _encode_array(name, wire, value)
            for dim, size in zip(wire.dims, out[name]["shape"]):
                _bind_dim(name, dim, size, dims)
            continue
        if isinstance(wire, StringList):
            value = [str(v) for v in value]
        elif isinstance(wire, Lineage):
            value = {str(k): v for k, v in value.items()}
        out[name] = _check_field(name, wire, value, dims)
    return msgpack.packb(out, use_bin_type=True)


# --------------------------------------------------------------------------------------------- decode

_SCALAR_TYPES = {"str": (str,), "int": (int,), "float": (float, int), "bool": (bool,), "bytes": (bytes,)}


def _check_scalar(name: str, kind: str, value: Any) -> Any:
    # bool is a subclass of int in Python; on the wire they are different types.
    if isinstance(value, bool) and kind != "bool":
        raise SchemaError(f"{name}: expected {kind}, got bool")
    if not isinstance(value, _SCALAR_TYPES[kind]):
        raise SchemaError(f"{name}: expected {kind}, got {type(value).__name__}")
    if kind == "float":
        value = float(value)
        if not math.isfinite(value):
            raise SchemaError(f"{name}: expected a finite float, got {value}")
    return value


def _bind_dim(name: str, dim: str, size: int, dims: dict[str, int]) -> None:
    bound = dims.setdefault(dim, size)
    if bound != size:
        raise SchemaError(f"{name}: dimension {dim} is {size} here but {bound} in an earlier field")


def _decode_array(name: str, spec: Array, value: Any, dims: dict[str, int]) -> np.ndarray:
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
        raise SchemaError(f"{name}: expected an array, a map with exactly dtype, shape and data")
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if dtype != spec.dtype:
        raise SchemaError(f"{name}: expected dtype {spec.dtype}, got {dtype!r}")
    if not isinstance(shape, list) or len(shape) != len(spec.dims):
        raise SchemaError(f"{name}: expected a shape of rank {len(spec.dims)} {spec.dims}, got {shape!r}")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise SchemaError(f"{name}: shape must be non-negative integers, got {shape!r}")
    if not isinstance(data, bytes):
        raise SchemaError(f"{name}: data must be bytes, got {type(data).__name__}")
    np_dtype = np.dtype(dtype).newbyteorder("<")
    # Python ints do not overflow; the comparison with the bytes present bounds every allocation below.
    if math.prod(shape) * np_dtype.itemsize != len(data):
        raise SchemaError(
            f"{name}: shape {shape} of {dtype} needs {math.prod(shape) * np_dtype.itemsize} bytes, got {len(data)}"
        )
    for dim, size in zip(spec.dims, shape):
        _bind_dim(name, dim, size, dims)
    arr = np.frombuffer(data, dtype=np_dtype).reshape(shape).astype(np_dtype.newbyteorder("="), copy=True)
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise SchemaError(f"{name}: contains NaN or infinity")
    return arr


def _check_field(name: str, wire: WireType, value: Any, dims: dict[str, int]) -> Any:
    if isinstance(wire, Array):
        return _decode_array(name, wire, value, dims)
    if isinstance(wire, StringList):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SchemaError(f"{name}: expected a list of strings")
        _bind_dim(name, wire.dim, len(value), dims)
        return value
    if isinstance(wire, Lineage):
        if not isinstance(value, dict) or len(value) > MAX_LINEAGE_ENTRIES:
            raise SchemaError(f"{name}: expected a map of at most {MAX_LINEAGE_ENTRIES} entries")
        for key, item in value.items():
            if not isinstance(key, str) or not (item is None or isinstance(item, (str, int, float, bool))):
                raise SchemaError(f"{name}: entry {key!r} must map a string to a string, number, bool or null")
            if isinstance(item, float) and not math.isfinite(item):
                raise SchemaError(f"{name}: entry {key!r} is not a finite number")
        return value
    return _check_scalar(name, wire.kind, value)


def decode(data: bytes, expected: type | tuple[type, ...] | None = None) -> Any:
    """Decode and validate msgpack bytes into a message.

    Args:
        data: the raw bytes of one message.
        expected: if given, the message must be of this type (e.g. the type a topic carries), or of one of these.
    Raises:
        SchemaError: for anything that is not a valid message of a known schema and version.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError(f"expected bytes, got {type(data).__name__}")
    size = len(data)
    try:
        # Every container and blob is bounded by the input's own size, so a forged length cannot allocate more.
        raw = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types (ExtraData, ValueError, UnicodeDecodeError...)
        raise SchemaError(f"not a msgpack message: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, dict):
        raise SchemaError(f"a message must be a msgpack map, got {type(raw).__name__}")
    schema, version = raw.get("schema"), raw.get("version")
    cls = MESSAGE_TYPES.get(schema) if isinstance(schema, str) else None
    if cls is None:
        raise SchemaError(f"unknown schema {schema!r}")
    allowed = expected if isinstance(expected, tuple) else (expected,)
    if expected is not None and cls not in allowed:
        raise SchemaError(f"expected a {' or '.join(repr(t.SCHEMA) for t in allowed)} message, got {schema!r}")
    if version != cls.VERSION:
        upgrade = cls.UPGRADES.get(version) if isinstance(version, int) and not isinstance(version, bool) else None
        if upgrade is None:
            raise SchemaError(
                f"{schema}: unsupported schema version {version!r} (this build reads version {cls.VERSION}"
                f"{''.join(f', {v}' for v in sorted(cls.UPGRADES))})"
            )
        raw = upgrade(raw)
    wire_fields = cls.wire_fields()
    names = {name for name, _ in wire_fields}
    present = set(raw) - {"schema", "version"}
    if present != names:
        missing, extra = sorted(names - present), sorted(str(k) for k in present - names)
        raise SchemaError(f"{schema}: missing fields {missing}, unexpected fields {extra}")
    dims: dict[str, int] = {}
    values = {name: _check_field(name, wire, raw[name], dims) for name, wire in wire_fields}
    cls.check(values, dims)
    return cls(**values)
