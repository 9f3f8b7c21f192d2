"""The weight store as it was before one-pass digests and memory-mapped loads, kept to be measured side by side
with today's (benchmarks/run.py, section 5): save_file, fsync, then sha256 over the file; read the whole file,
sha256 it, parse the bytes into tensors (a second copy), then copy them into the model."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from common.storage import fsync_dir, fsync_file


def publish(root: Path, name: str, version: int, state: dict[str, torch.Tensor]) -> tuple[str, str]:
    path, tmp = root / f"{name}-v{version:08d}.safetensors", root / f".{name}-v{version:08d}.tmp"
    save_file(state, str(tmp))
    fsync_file(tmp)
    digest = hashlib.sha256()
    with open(tmp, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    os.replace(tmp, path)
    fsync_dir(root)
    return str(path), digest.hexdigest()


def read(path: str, sha256: str) -> dict[str, torch.Tensor]:
    data = Path(path).read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError("checksum")
    return load_safetensors(data)


def load_into(module: torch.nn.Module, path: str, sha256: str) -> None:
    own = module.state_dict()
    with torch.no_grad():
        for name, tensor in read(path, sha256).items():
            own[name].copy_(tensor)


def load_into_vllm_worker(worker, path: str, sha256: str) -> None:
    """Run in vLLM's worker process through ``collective_rpc``."""
    worker.model_runner.reload_weights(weights_iterator=iter(read(path, sha256).items()))
