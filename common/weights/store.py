"""Writing the weight store: snapshots (whole, sharded by a learner of several ranks, or deltas against the last full
one), their digests as written, and pruning. See :mod:`common.weights` for the store's promises."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np
import torch
from safetensors.torch import save_file

from common.schema import chain_link, split_link
from common.storage import state_nbytes, write_or_explain

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
