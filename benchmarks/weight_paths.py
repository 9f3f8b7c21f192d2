"""The ways an actor update travels from the learner into a generator's model, as timed pairs (publish, load), shared
by ``benchmarks/run.py`` (CPU) and ``benchmarks/gpu.py`` (a GPU machine: it imports nothing that needs Kafka or
vLLM).

A path is ``label -> (publish, load)``: ``publish`` is the learner's side of one new version, ``load`` the
generator's (the model's weights are that version when it returns).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from common.broadcast import WeightReceiver, WeightSender
from common.weights import Snapshot, WeightStore, load_snapshot_into, load_state_into
from services.transport.brokers.local_broker import free_port

__all__ = ["StorePath", "broadcast_paths", "interleaved", "scratch_dir"]

SHM = "/dev/shm"

TimedPath = tuple[Callable[[], None], Callable[[], None]]


def scratch_dir(need_bytes: int = 0) -> tempfile.TemporaryDirectory:
    """A temporary weight store on tmpfs where there is one with room for ``need_bytes``: a disk measures itself,
    not the store (this VM's takes 0.16 to 6.3 s for the same 538 MB write)."""
    shm = os.path.isdir(SHM) and shutil.disk_usage(SHM).free > need_bytes
    return tempfile.TemporaryDirectory(dir=SHM if shm else None)


def interleaved(paths: dict[str, TimedPath], rounds: int) -> dict[str, tuple[float, float]]:
    """Median (publish, load) seconds per path, the paths taking turns in each round: a VM now and then stalls
    a few seconds on fresh memory (its host backs pages at first touch), and turns spread that over every path."""
    times = {label: ([], []) for label in paths}
    for _ in range(rounds + 1):  # the first round warms up
        for label, (publish, load) in paths.items():
            for fn, out in zip((publish, load), times[label]):
                started = time.perf_counter()
                fn()
                out.append(time.perf_counter() - started)
    return {label: (statistics.median(p[1:]), statistics.median(ld[1:])) for label, (p, ld) in times.items()}


class StorePath:
    """The store alone: the learner writes the snapshot with its digest (pruning the one before), the generator
    verifies it and copies it into ``into``. ``snapshot`` is the newest one published."""

    def __init__(self, tmp: Path, state: dict[str, torch.Tensor], into: torch.nn.Module, algorithm: str = "blake3"):
        self.store = WeightStore(tmp / f"store-{algorithm}", algorithm)
        self.state, self.into = state, into
        self.snapshot: Snapshot | None = None

    def publish(self) -> None:
        version = self.snapshot.version + 1 if self.snapshot else 1
        self.snapshot = self.store.save_state("actor", version, self.state)
        self.store.prune("actor", 2, version)

    def load(self) -> None:
        load_snapshot_into(self.into, self.snapshot.chain)

    @property
    def timed(self) -> TimedPath:
        return self.publish, self.load


@contextmanager
def broadcast_paths(tmp: Path, state: dict[str, torch.Tensor], into: torch.nn.Module) -> Iterator[dict[str, TimedPath]]:
    """The broadcast path (``weights.broadcast``), a receiver in this process (its own thread, as in a generator):
    as the learner runs it (the snapshot written to the store while the tensors are sent; the copy from the
    received buffers at the announcement), and the transfer alone (send and copy, no store)."""
    address = f"127.0.0.1:{free_port()}"
    sender = WeightSender(address, 1, 60.0, "blake3")
    receiver = WeightReceiver(address, 60.0, "blake3", name="bench")
    store = WeightStore(tmp / "broadcast")
    version, sent = iter(range(1, 10_000)), {}

    def send(with_store: bool):
        v = next(version)
        if with_store:
            _, sent["digest"] = sender.send_and_save(store, "actor", v, state)  # as the learner publishes
            store.prune("actor", 2, v)
        else:
            sent["digest"] = sender.send(v, state)
        sent["version"] = v
        if not sent["digest"]:
            raise RuntimeError(f"the broadcast of v{v} did not reach the receiver")

    def load():
        if not receiver.load_into(sent["version"], sent["digest"], lambda t: load_state_into(into, t, "broadcast")):
            raise RuntimeError("the receiver does not hold what was sent")

    try:
        yield {
            "after, blake3, broadcast while the store is written (weights.broadcast)": (lambda: send(True), load),
            "after, blake3, broadcast alone (no store)": (lambda: send(False), load),
        }
    finally:
        receiver.close()
        sender.close()
