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
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.schema import chain_link, split_link
from common.storage import state_nbytes, write_or_explain

__all__ = [
    "Snapshot",
    "WeightIntegrityError",
    "WeightStore",
    "check_fits",
    "first_names",
    "is_adapted",
    "published_tensors",
    "DIGEST_ALGORITHMS",
    "delta_state",
    "load_snapshot_into",
    "open_snapshot",
    "open_weights",
    "snapshot_shapes",
    "write_part",
    "snapshot_state",
]

# A snapshot is one file, or (written by a sharded learner) an index plus a folder of parts.
_SNAPSHOT_NAME = re.compile(r"^(?P<model>[a-z0-9_-]+)-v(?P<version>\d{8})\.(safetensors|index\.json|parts)$")
INDEX_SUFFIX = ".index.json"


class WeightIntegrityError(RuntimeError):
    """A snapshot is missing, does not match its announced checksum, or does not fit the model."""


@dataclass(frozen=True)
class Snapshot:
    model: str
    version: int
    uri: str
    digest: str  # <algorithm>:<hex> of the file's bytes
    num_bytes: int
    # The files that make this version, from the newest full snapshot to this one, each "<digest> <uri>"; one
    # entry when this snapshot is full (see WeightStore).
    chain: tuple[str, ...] = ()
    is_delta: bool = False


@dataclass
class _Published:
    """What the store last wrote for a model: the state it held (to diff the next one against) and its chain."""

    version: int
    state: dict[str, torch.Tensor]
    chain: tuple[str, ...]


DIGEST_ALGORITHMS = {
    "blake3": lambda: blake3.blake3(max_threads=blake3.blake3.AUTO),
    "sha256": hashlib.sha256,
}


def new_hasher(algorithm: str):
    if algorithm not in DIGEST_ALGORITHMS:
        raise WeightIntegrityError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(DIGEST_ALGORITHMS)})")
    return DIGEST_ALGORITHMS[algorithm]()


def tensor_bytes(tensor: torch.Tensor):
    """The bytes of a contiguous CPU tensor as safetensors writes them (little-endian, row-major), not copied."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _digest_as_written(path: Path, state: dict[str, torch.Tensor], algorithm: str) -> str:
    """The digest of the safetensors file at ``path``, written from ``state``: its header read back from the file,
    the tensors digested from memory in the order of their offsets (safetensors leaves no gaps between them)."""
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        header_bytes = fh.read(int.from_bytes(prefix, "little"))
    header = json.loads(header_bytes)
    header.pop("__metadata__", None)
    hasher = new_hasher(algorithm)
    hasher.update(prefix)
    hasher.update(header_bytes)
    end = 0
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        start, stop = entry["data_offsets"]
        if start != end or stop - start != state[name].nbytes:
            raise RuntimeError(f"{path}: tensor {name} is not where its bytes were expected; digest not taken")
        hasher.update(tensor_bytes(state[name]))
        end = stop
    if path.stat().st_size != 8 + len(header_bytes) + end:
        raise RuntimeError(f"{path}: {path.stat().st_size} bytes, not the {8 + len(header_bytes) + end} written")
    return f"{algorithm}:{hasher.hexdigest()}"


def first_names(module: torch.nn.Module) -> set[str]:
    """The names of ``module``'s state with each shared (tied) tensor once, under its first name.

    For tied embeddings that is ``model.embed_tokens.weight``, as in a transformers checkpoint: loaders that skip
    ``lm_head.weight`` for tied models (vLLM's does) still find the embedding. Ties are read from parameter
    identity, so this works for sharded modules and on the meta device, where there are no data pointers.
    """
    tensors = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    seen, names = set(), set()
    for name in module.state_dict():
        key = id(tensors.get(name, name))
        if key not in seen:
            seen.add(key)
            names.add(name)
    return names


def is_adapted(module: torch.nn.Module) -> bool:
    """Whether ``module`` carries LoRA adapters (a peft model): its snapshots then hold the adapters alone."""
    return hasattr(module, "peft_config")


def published_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a snapshot of ``module`` holds, under their names there, sharing storage with the module.

    A LoRA-adapted model (peft) publishes its adapters alone, named as peft saves them (``adapter_model.safetensors``,
    which vLLM's LoRA loader reads too); any other module its whole state, each tied tensor once.
    """
    if is_adapted(module):  # the active adapter's (one model may carry several: services/generator/samplers.py)
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(module, adapter_name=module.active_adapter)
    keep = first_names(module)
    return {name: t for name, t in module.state_dict().items() if name in keep}


def snapshot_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state as a snapshot holds it (:func:`published_tensors`), on the CPU."""
    return {name: t.detach().cpu().contiguous() for name, t in published_tensors(module).items()}


class WeightStore:
    """A directory of snapshots named ``<model>-v<version>.safetensors``, digested with ``digest``.

    With ``full_every`` > 1 a snapshot may be a *delta*: for each tensor with changed elements, a bit mask of them
    (``<name>:mask``) and their new values (``<name>:values``), against the snapshot before it, whose digest it
    names (metadata ``base``). Every ``full_every`` versions, after a restart, and whenever a delta would not be
    under half the full size (float32 weights change everywhere at every update), the snapshot is full. A reader
    applies the chain from the newest full snapshot (:func:`open_weights`), so one that missed versions needs
    nothing else. The store keeps the last published state of each model in memory to diff against.
    """

    def __init__(self, root: Path, digest: str = "blake3", full_every: int = 1):
        new_hasher(digest)  # an unknown algorithm fails here, not at the first snapshot
        if full_every < 1:
            raise ValueError(f"full_every must be at least 1, got {full_every}")
        self.root, self.digest, self.full_every = Path(root), digest, full_every
        self.root.mkdir(parents=True, exist_ok=True)
        self.published: dict[str, _Published] = {}

    def save(self, model_name: str, version: int, module: torch.nn.Module) -> Snapshot:
        return self.save_state(model_name, version, snapshot_state(module))

    def save_state(self, model_name: str, version: int, state: dict[str, torch.Tensor]) -> Snapshot:
        """Write ``state`` (CPU tensors, each tied tensor once: :func:`snapshot_state`) as snapshot ``version``."""
        last = self.published.get(model_name)
        delta = None
        if last is not None and last.version == version - 1 and len(last.chain) < self.full_every:
            delta = delta_state(last.state, state, max_bytes=state_nbytes(state) // 2)
        # At most one metadata entry: safetensors writes its metadata map in hash order, which differs between
        # processes, and the digest covers the header, so a second entry would give the same weights another digest
        # in another process (streamppo replay compares digests across processes). The file's name says the rest.
        metadata = {"base": split_link(last.chain[-1])[0]} if delta is not None else None
        path = self.root / f"{model_name}-v{version:08d}.safetensors"
        digest = _write_safetensors(
            path, state if delta is None else delta, self.digest, f"the {model_name} v{version} snapshot", metadata
        )
        link = chain_link(digest, str(path.resolve()))
        chain = (*last.chain, link) if delta is not None else (link,)
        if self.full_every > 1:
            self.published[model_name] = _Published(version, {k: v.clone() for k, v in state.items()}, chain)
        return Snapshot(model_name, version, str(path.resolve()), digest, path.stat().st_size, chain, delta is not None)

    def prune(self, model_name: str, keep: int, current: int) -> list[Path]:
        """Keep the snapshots of ``model_name`` at versions ``current − keep + 1 .. current``; delete the rest.

        Versions above ``current`` are left over from a run this store held before, or from updates a crashed
        learner rolled back: they are deleted too, so they can never push the snapshot just announced out of the
        window. Returns what was deleted.
        """
        last = self.published.get(model_name)
        oldest = current - keep + 1
        if last is not None and last.version == current:  # every link of the current chain stays
            oldest = min(oldest, current - len(last.chain) + 1)
        doomed = [
            p
            for p in self.root.iterdir()
            if (m := _SNAPSHOT_NAME.match(p.name))
            and m["model"] == model_name
            and not oldest <= int(m["version"]) <= current
        ]
        for path in doomed:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        return doomed

    def save_sharded(self, model_name: str, version: int, write_parts) -> Snapshot:
        """Snapshot ``version`` written in parts by the learner's ranks, in parallel, and an index that names them.

        ``write_parts(folder)`` has every rank write its part into ``folder`` (:func:`write_part`) and returns, on
        this rank, ``[(file name, digest, {tensor name: shape}), ...]`` for all parts. The index, like transformers'
        ``model.safetensors.index.json``, maps each tensor to its part and lists each part's digest; the
        announcement carries the index's digest, so the index vouches for the parts. Sharded snapshots are full.
        """
        stem = f"{model_name}-v{version:08d}"
        folder, index = self.root / f"{stem}.parts", self.root / f"{stem}{INDEX_SUFFIX}"
        staging = self.root / f".{stem}.parts.{os.getpid()}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(mode=0o755)
        parts = write_parts(str(staging))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staging, folder)
        body = json.dumps(
            {
                "metadata": {"model": model_name, "version": str(version), "format": "streamppo-sharded"},
                "parts": {name: digest for name, digest, _ in parts},
                "weight_map": {tensor: name for name, _, shapes in parts for tensor in shapes},
                "shapes": {tensor: list(shape) for _, _, shapes in parts for tensor, shape in shapes.items()},
            },
            indent=1,
        ).encode()
        hasher = new_hasher(self.digest)
        hasher.update(body)
        tmp = index.with_name(f".{index.name}.{os.getpid()}.tmp")
        tmp.write_bytes(body)
        os.chmod(tmp, 0o644)
        os.replace(tmp, index)
        digest = f"{self.digest}:{hasher.hexdigest()}"
        size = len(body) + sum((folder / name).stat().st_size for name, _, _ in parts)
        link = chain_link(digest, str(index.resolve()))
        self.published.pop(model_name, None)  # a delta after this would need the whole state on one rank
        return Snapshot(model_name, version, str(index.resolve()), digest, size, (link,), False)


def plan_parts(nbytes: dict[str, int], parts: int) -> dict[str, int]:
    """Which part of a sharded snapshot holds each tensor: largest first, each to the part with the fewest bytes so
    far, ties by name, so that every rank computes the same plan. ``nbytes``: tensor name -> its size."""
    load, owner = [0] * parts, {}
    for name in sorted(nbytes, key=lambda n: (-nbytes[n], n)):
        owner[name] = load.index(min(load))
        load[owner[name]] += nbytes[name]
    return owner


def part_name(part: int, parts: int) -> str:
    """The file name of part ``part`` of ``parts`` in a sharded snapshot's folder."""
    return f"part-{part:05d}-of-{parts:05d}.safetensors"


def write_part(folder: str, name: str, state: dict[str, torch.Tensor], algorithm: str) -> str:
    """Write one rank's part of a sharded snapshot (CPU tensors) as ``folder/name``; returns its digest."""
    return _write_safetensors(Path(folder) / name, state, algorithm, f"snapshot part {name}")


def _write_safetensors(
    path: Path, state: dict[str, torch.Tensor], algorithm: str, what: str, metadata: dict[str, str] | None = None
) -> str:
    """Write ``state`` to a temporary name, digest it as written, rename it to ``path``; returns the digest."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")

    def write() -> None:
        save_file(state, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o644)  # safetensors writes 0600; readers may run under another uid on a shared volume

    write_or_explain(path.parent, what, state_nbytes(state) + (1 << 20), write, lambda: tmp.unlink(True))
    digest = _digest_as_written(tmp, state, algorithm)
    os.replace(tmp, path)
    return digest


_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of its width: equal bits, equal integers (NaN included)."""
    return tensor.reshape(-1).view(_INTEGER_OF_WIDTH[tensor.element_size()])


def delta_state(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], max_bytes: int | None = None
) -> dict[str, torch.Tensor] | None:
    """A delta snapshot's tensors: for each tensor of ``after`` that differs from ``before`` in any bit, a bit mask
    of the changed elements (``<name>:mask``) and their values (``<name>:values``). None when a full snapshot is
    needed or as good: other names or shapes, or a delta of more than ``max_bytes``."""
    if before.keys() != after.keys() or any(before[k].shape != after[k].shape for k in after):
        return None
    delta, size = {}, 0
    for name, tensor in after.items():
        changed = _bits(before[name]) != _bits(tensor)
        if not changed.any():
            continue
        delta[f"{name}:mask"] = torch.from_numpy(np.packbits(changed.numpy()))
        delta[f"{name}:values"] = tensor.reshape(-1)[changed]
        size += delta[f"{name}:mask"].nbytes + delta[f"{name}:values"].nbytes
        if max_bytes is not None and size > max_bytes:
            return None
    return delta


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
