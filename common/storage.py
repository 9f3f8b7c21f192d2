"""Writing state to disk so that it survives a crash, and saying so clearly when the disk is full.

Checkpoints and weight snapshots are written under a temporary name and renamed into place. Checkpoints are also
fsynced, with their directory after the rename: a crash at any moment leaves either the old one or the complete new
one. (Snapshots are not: a torn one fails its digest, and the learner writes them again from its checkpoint.)
Space is checked before writing, and a write that fails for lack of space raises :class:`NoSpaceError` naming the
directory and the size needed, never a bare I/O error, after removing what it had half-written.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = ["NoSpaceError", "fsync_dir", "fsync_file", "state_nbytes", "write_or_explain"]

_MB = 1 << 20


class NoSpaceError(OSError):
    """The disk (or quota) has no room for a checkpoint or snapshot; the previous one is left as it was."""


def state_nbytes(state) -> int:
    """Bytes of the tensors in a nested state (dicts, lists, tuples of tensors and plain values)."""
    import torch  # here: the module is also used where nothing else needs torch (`streamppo status`)

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_nbytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(state_nbytes(value) for value in state)
    return 0


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _no_space(directory: Path, what: str, needed: int) -> NoSpaceError:
    free = shutil.disk_usage(directory).free
    return NoSpaceError(
        errno.ENOSPC,
        f"no space left on {directory} for {what} (needs {needed / _MB:.1f} MB, {free / _MB:.1f} MB free)",
    )


def write_or_explain(directory: Path, what: str, needed: int, write: Callable[[], None], cleanup: Callable[[], None]):
    """Run ``write()`` (which writes about ``needed`` bytes into ``directory``) if there is room for it.

    On a write that fails for lack of space (ENOSPC, EDQUOT, or torch's stream error while the disk is full),
    ``cleanup()`` removes the partial output and :class:`NoSpaceError` is raised; other errors are re-raised after
    the same cleanup.
    """
    if shutil.disk_usage(directory).free < needed:
        raise _no_space(directory, what, needed)
    try:
        write()
    except (OSError, RuntimeError) as exc:
        cleanup()
        full = getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        if full or shutil.disk_usage(directory).free < needed:
            raise _no_space(directory, what, needed) from exc
        raise
