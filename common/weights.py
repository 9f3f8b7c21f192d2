"""The weight store: versioned safetensors snapshots with a sha256, in a shared directory.

The learner saves a snapshot and announces ``{model, version, uri, sha256}``; generator and advantage replicas load
it. A snapshot is written to a temporary name and renamed, so a reader never sees a half-written file under its
final name; a file that was truncated or corrupted anyway fails its checksum and is rejected with
:class:`WeightIntegrityError`, leaving the model untouched.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from common.storage import fsync_dir, fsync_file, state_nbytes, write_or_explain

__all__ = [
    "Snapshot",
    "WeightIntegrityError",
    "WeightStore",
    "check_fits",
    "first_names",
    "load_snapshot_into",
    "read_snapshot",
    "snapshot_state",
]

_SNAPSHOT_NAME = re.compile(r"^(?P<model>[a-z0-9_-]+)-v(?P<version>\d{8})\.safetensors$")


class WeightIntegrityError(RuntimeError):
    """A snapshot is missing, does not match its announced checksum, or does not fit the model."""


@dataclass(frozen=True)
class Snapshot:
    model: str
    version: int
    uri: str
    sha256: str
    num_bytes: int


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


def snapshot_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state as a snapshot holds it: on the CPU, each tied tensor once."""
    keep = first_names(module)
    return {name: t.detach().cpu().contiguous() for name, t in module.state_dict().items() if name in keep}


class WeightStore:
    """A directory of snapshots named ``<model>-v<version>.safetensors``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def save(self, model_name: str, version: int, module: torch.nn.Module) -> Snapshot:
        return self.save_state(model_name, version, snapshot_state(module))

    def save_state(self, model_name: str, version: int, state: dict[str, torch.Tensor]) -> Snapshot:
        """Write ``state`` (CPU tensors, each tied tensor once: :func:`snapshot_state`) as snapshot ``version``."""
        path = self.root / f"{model_name}-v{version:08d}.safetensors"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")

        def write() -> None:
            save_file(state, str(tmp), metadata={"model": model_name, "version": str(version)})
            os.chmod(tmp, 0o644)  # safetensors writes 0600; readers may run under another uid on a shared volume
            fsync_file(tmp)

        needed = state_nbytes(state) + (1 << 20)
        write_or_explain(self.root, f"the {model_name} v{version} snapshot", needed, write, lambda: tmp.unlink(True))
        digest = _sha256(tmp)
        os.replace(tmp, path)
        fsync_dir(self.root)
        return Snapshot(model_name, version, str(path.resolve()), digest, path.stat().st_size)

    def prune(self, model_name: str, keep: int, current: int) -> list[Path]:
        """Keep the snapshots of ``model_name`` at versions ``current − keep + 1 .. current``; delete the rest.

        Versions above ``current`` are left over from a run this store held before, or from updates a crashed
        learner rolled back: they are deleted too, so they can never push the snapshot just announced out of the
        window. Returns what was deleted.
        """
        doomed = [
            p
            for p in self.root.iterdir()
            if (m := _SNAPSHOT_NAME.match(p.name))
            and m["model"] == model_name
            and not current - keep < int(m["version"]) <= current
        ]
        for path in doomed:
            path.unlink(missing_ok=True)
        return doomed


def read_snapshot(uri: str, sha256: str) -> dict[str, torch.Tensor]:
    """Read the snapshot at ``uri``, verify it against ``sha256`` and parse it; the file is read once.

    Raises:
        WeightIntegrityError: missing or unreadable file, checksum mismatch, or not a safetensors file.
    """
    path = Path(uri.removeprefix("file://"))
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WeightIntegrityError(f"snapshot {uri} cannot be read: {exc}") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise WeightIntegrityError(f"snapshot {uri} has sha256 {actual[:12]}…, announced {sha256[:12]}…; rejected")
    try:
        return load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error type for malformed headers
        raise WeightIntegrityError(f"snapshot {uri} is not a valid safetensors file: {exc}") from None


def check_fits(uri: str, shapes: dict[str, tuple[int, ...]], module: torch.nn.Module) -> None:
    """Check that tensors named ``shapes`` (name → shape) are exactly what ``module``'s state needs.

    ``module`` may live on the meta device: only names, shapes and tying are looked at. Keys absent from the
    snapshot must be tied to a key present in it (snapshots keep one name per storage).

    Raises:
        WeightIntegrityError: naming the missing, unexpected and wrongly shaped tensors.
    """
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


def load_snapshot_into(module: torch.nn.Module, uri: str, sha256: str) -> None:
    """Verify the snapshot at ``uri`` against ``sha256`` and load it into ``module`` in place.

    Raises:
        WeightIntegrityError: missing file, checksum mismatch, or tensors that do not fit the module. The module
        is unchanged in every one of these cases.
    """
    state = read_snapshot(uri, sha256)
    check_fits(uri, {k: tuple(v.shape) for k, v in state.items()}, module)
    own = module.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor)
