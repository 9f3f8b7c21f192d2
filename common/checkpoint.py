"""Learner checkpoints: a directory per version, switched to with an atomic pointer file.

``<dir>/ckpt-<version>/`` holds the trainer's state (``trainer.pt``: tensors and plain values only, read back with
``torch.load(weights_only=True)``, which unpickles no code; a sharded learner adds ``shards/``, written by all its
ranks with torch.distributed.checkpoint) and ``learner.json``: the handled batch ids, counters and input offsets.
``<dir>/LATEST`` names the newest complete checkpoint; it is replaced only after that checkpoint is fully
written (files and directory fsynced), so a process killed at any moment leaves the previous checkpoint intact; a
disk without room for the new one raises :class:`common.storage.NoSpaceError` and changes nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from common.storage import fsync_dir, fsync_file, write_or_explain

__all__ = ["latest_checkpoint_version", "load_latest_checkpoint", "next_epoch", "save_checkpoint"]


def save_checkpoint(
    directory: Path, version: int, write_state: Callable[[Path], None], needed_bytes: int, meta: dict, keep: int = 2
) -> Path:
    """Write checkpoint ``version`` and point ``LATEST`` at it; raises :class:`NoSpaceError` (the previous
    checkpoint still in place and pointed at) when the disk has no room for it.

    ``write_state(folder)`` writes the trainer's state into the new checkpoint's folder (a sharded learner's ranks
    each write their shards there, so the folder must be on storage every rank sees); ``needed_bytes`` is its
    size, for the message when it does not fit.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = _new_name(directory, version)
    tmp = directory / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)

    def write() -> None:
        tmp.mkdir()
        write_state(tmp)
        (tmp / "learner.json").write_text(json.dumps(meta))
        fsync_file(tmp / "learner.json")
        fsync_dir(tmp)

    needed = needed_bytes + len(json.dumps(meta)) + (1 << 20)  # + headers and the pickled rest
    write_or_explain(directory, f"checkpoint v{version}", needed, write, lambda: shutil.rmtree(tmp, True))
    final = directory / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = directory / ".LATEST.tmp"
    pointer.write_text(name)
    fsync_file(pointer)
    os.replace(pointer, directory / "LATEST")
    fsync_dir(directory)
    for old in sorted(p for p in directory.glob("ckpt-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _new_name(directory: Path, version: int) -> str:
    """``ckpt-<version>``, or ``ckpt-<version>.<n>`` for another checkpoint of the version LATEST points at (input
    consumed without an update): the checkpoint in use is never removed before its successor is in place."""
    pointer = directory / "LATEST"
    latest = pointer.read_text().strip() if pointer.is_file() else None
    name, n = f"ckpt-{version:08d}", 0
    while latest is not None and name <= latest and latest.startswith(f"ckpt-{version:08d}"):
        n += 1
        name = f"ckpt-{version:08d}.{n:04d}"
    return name


def latest_checkpoint_version(directory: Path) -> int | None:
    """The version of the newest complete checkpoint in ``directory`` (read from its name), or None."""
    pointer = Path(directory) / "LATEST"
    if not pointer.is_file():
        return None
    return int(pointer.read_text().strip().removeprefix("ckpt-").split(".")[0])


def load_latest_checkpoint(directory: Path) -> tuple[Path, dict] | None:
    """``(folder, meta)`` of the newest complete checkpoint, or None if there is none; the trainer reads its
    state from the folder."""
    pointer = Path(directory) / "LATEST"
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    return path, json.loads((path / "learner.json").read_text())


def next_epoch(directory: Path) -> int:
    """One more than the last epoch started from ``directory`` (1 for the first), made durable before it is used.

    A learner takes a new epoch at each start; its announcements carry it, so readers can tell a learner that was
    replaced (a zombie, still running somewhere) from the one that replaced it.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "EPOCH"
    epoch = int(path.read_text()) + 1 if path.is_file() else 1
    tmp = directory / ".EPOCH.tmp"
    tmp.write_text(str(epoch))
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(directory)
    return epoch
