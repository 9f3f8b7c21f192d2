"""Reading the weight store: a snapshot (or a chain of a full one and its deltas) opened through a memory map and
verified against its digest, its shapes checked against a model, and loaded into it. See :mod:`common.weights`."""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from common.schema import split_link
from common.weights.store import INDEX_SUFFIX, WeightIntegrityError, is_adapted, new_hasher, published_tensors


def _apply_delta(state: dict[str, torch.Tensor], delta: dict[str, torch.Tensor], uri: str) -> None:
    """Patch ``state`` (name -> tensor) with a delta's changed elements; patched tensors are new tensors."""
    for key in delta:
        name, _, part = key.rpartition(":")
        if part not in ("mask", "values") or name not in state or f"{name}:mask" not in delta:
            raise WeightIntegrityError(f"delta snapshot {uri} has an entry {key!r} that fits no tensor of its base")
        if part == "values":
            continue
        target = state[name].reshape(-1).clone()
        bits = np.unpackbits(delta[key].numpy(), count=target.numel()).astype(bool)
        values = delta.get(f"{name}:values")
        if values is None or values.numel() != int(bits.sum()) or values.dtype != target.dtype:
            raise WeightIntegrityError(f"delta snapshot {uri}: the values of {name} do not match its mask")
        target[torch.from_numpy(bits)] = values
        state[name] = target.view(state[name].shape)


@contextmanager
def open_weights(chain: list[str] | tuple[str, ...]) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of the last version of ``chain`` (entries ``"<digest> <uri>"``: a full snapshot, then deltas):
    the full snapshot's memory-mapped views, with each tensor a delta changed patched. Every link is verified
    against its digest, and each delta against the link before it, before anything is returned.

    Raises:
        WeightIntegrityError: an empty chain, or a link that is missing, damaged or not chained to the one before.
    """
    if not chain:
        raise WeightIntegrityError("no snapshot named: the announcement's chain is empty")
    with ExitStack() as stack:
        state = None
        previous = None
        for entry in chain:
            digest, uri = split_link(entry)
            tensors, metadata = stack.enter_context(_open_verified(uri, digest))
            base = metadata.get("base")
            if state is None:
                if base is not None:
                    raise WeightIntegrityError(f"snapshot {uri} is a delta, but its chain starts with it")
                state = dict(tensors)
            else:
                if base != previous:
                    raise WeightIntegrityError(f"delta snapshot {uri} applies to {base}, not to {previous}")
                _apply_delta(state, tensors, uri)
            previous = digest
        yield state


def snapshot_shapes(uri: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a full snapshot, from its header or index alone (before it is verified).

    Raises:
        WeightIntegrityError: the file cannot be read as a snapshot.
    """
    path = uri.removeprefix("file://")
    try:
        if path.endswith(INDEX_SUFFIX):
            return {name: tuple(shape) for name, shape in json.loads(Path(path).read_bytes())["shapes"].items()}
        with safe_open(path, framework="pt") as snapshot:
            return {name: tuple(snapshot.get_slice(name).get_shape()) for name in snapshot.keys()}
    except Exception as exc:  # OSError, a malformed header or index
        raise WeightIntegrityError(f"snapshot {uri} cannot be opened: {exc}") from None


@contextmanager
def open_snapshot(uri: str, digest: str) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of the snapshot at ``uri``, verified against ``digest``: views of the memory-mapped file, valid
    inside the ``with`` block. The file is read once, by the digest; the tensors are its pages.

    Raises:
        WeightIntegrityError: missing or unreadable file, digest mismatch, or not a safetensors file.
    """
    with _open_verified(uri, digest) as (tensors, _):
        yield tensors


@contextmanager
def _open_verified(uri: str, digest: str) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """:func:`open_snapshot`'s tensors and the file's metadata (none for a sharded snapshot, which is full)."""
    algorithm, _, expected = digest.partition(":")
    path = Path(uri.removeprefix("file://"))
    if path.name.endswith(INDEX_SUFFIX):
        with _open_sharded(path, algorithm, expected) as tensors:
            yield tensors, {}
        return
    try:
        with open(path, "rb") as fh:
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise WeightIntegrityError(f"snapshot {uri} cannot be read: {exc}") from None
    with ExitStack() as stack:
        stack.callback(mapped.close)
        hasher = new_hasher(algorithm)
        with memoryview(mapped) as view:
            hasher.update(view)
        actual = hasher.hexdigest()
        if actual != expected:
            raise WeightIntegrityError(
                f"snapshot {uri} has {algorithm} {actual[:12]}…, announced {expected[:12]}…; rejected"
            )
        try:
            snapshot = stack.enter_context(safe_open(str(path), framework="pt"))
            tensors = {name: snapshot.get_tensor(name) for name in snapshot.keys()}
            metadata = snapshot.metadata() or {}
        except Exception as exc:  # safetensors raises its own error type for malformed headers
            raise WeightIntegrityError(f"snapshot {uri} is not a valid safetensors file: {exc}") from None
        yield tensors, metadata


@contextmanager
def _open_sharded(index: Path, algorithm: str, expected: str) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of a sharded snapshot: its index verified against the announced digest, then every part
    against the digest the index lists for it, part by part."""
    try:
        body = index.read_bytes()
    except OSError as exc:
        raise WeightIntegrityError(f"snapshot index {index} cannot be read: {exc}") from None
    hasher = new_hasher(algorithm)
    hasher.update(body)
    if hasher.hexdigest() != expected:
        raise WeightIntegrityError(f"snapshot index {index} does not match its announced {algorithm}; rejected")
    try:
        listing = json.loads(body)
        parts, weight_map = dict(listing["parts"]), dict(listing["weight_map"])
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightIntegrityError(f"snapshot index {index} is malformed: {exc}") from None
    folder = index.with_name(index.name.removesuffix(INDEX_SUFFIX) + ".parts")
    with ExitStack() as stack:
        tensors: dict[str, torch.Tensor] = {}
        for name, digest in parts.items():
            if "/" in name or name.startswith("."):
                raise WeightIntegrityError(f"snapshot index {index} names a part outside its folder: {name!r}")
            part = stack.enter_context(open_snapshot(str(folder / name), digest))
            if any(weight_map.get(tensor) != name for tensor in part):
                raise WeightIntegrityError(f"snapshot part {name} holds tensors its index does not map to it")
            tensors.update(part)
        if set(tensors) != set(weight_map):
            raise WeightIntegrityError(f"snapshot index {index} maps tensors that no part holds")
        yield tensors


def check_fits(uri: str, shapes: dict[str, tuple[int, ...]], module: torch.nn.Module) -> None:
    """Check that tensors named ``shapes`` (name → shape) are exactly what ``module``'s state needs.

    ``module`` may live on the meta device: only names, shapes and tying are looked at. Keys absent from the
    snapshot must be tied to a key present in it (snapshots keep one name per storage).

    Raises:
        WeightIntegrityError: naming the missing, unexpected and wrongly shaped tensors.
    """
    if is_adapted(module):  # adapters: no ties, the names peft saves them under
        own = published_tensors(module)
        wrong = sorted(k for k in shapes if k in own and tuple(shapes[k]) != tuple(own[k].shape))
        missing, unexpected = sorted(set(own) - set(shapes)), sorted(set(shapes) - set(own))
        if missing or unexpected or wrong:
            raise WeightIntegrityError(
                f"snapshot {uri} does not fit the model's adapters: missing {missing[:3]}, unexpected "
                f"{unexpected[:3]}, wrong shape {wrong[:3]}"
            )
        return
    own = module.state_dict()
    # Tied names share one Parameter object (on the meta device too, where there is no data pointer).
    tensors = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    identity = {name: id(tensors.get(name, name)) for name in own}
    unexpected = sorted(set(shapes) - set(own))
    wrong = sorted(k for k in shapes if k in own and tuple(shapes[k]) != tuple(own[k].shape))
    present = {identity[k] for k in shapes if k in own}
    missing = sorted(k for k in set(own) - set(shapes) if identity[k] not in present)
    if unexpected or wrong or missing:
        raise WeightIntegrityError(
            f"snapshot {uri} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"wrong shape {wrong[:3]}"
        )


def load_snapshot_into(module: torch.nn.Module, chain: list[str] | tuple[str, ...]) -> None:
    """Verify the snapshots of ``chain`` (:func:`open_weights`) and copy their last version into ``module``.

    Raises:
        WeightIntegrityError: missing file, digest mismatch, a broken chain, or tensors that do not fit the module.
        The module is unchanged in every one of these cases.
    """
    uri = split_link(chain[-1])[1] if chain else "(none)"
    with open_weights(chain) as state:
        load_state_into(module, state, uri)


def load_state_into(module: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` (one tensor per storage, as snapshots hold it) into ``module``.

    Raises:
        WeightIntegrityError: tensors that do not fit the module (named after ``source``); the module is unchanged.
    """
    check_fits(source, {k: tuple(v.shape) for k, v in state.items()}, module)
    own = published_tensors(module) if is_adapted(module) else module.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)
