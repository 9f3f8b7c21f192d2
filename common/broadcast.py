"""The broadcast path for the actor's weights: from the learner's rank 0 straight into the generators' memory.

The store is the source of truth: every version is written there and announced, and late joiners, restarted
replicas and every fallback read it. The broadcast only shortens the way for the generators that are in the group
when an update is made: the learner sends the tensors over a ``torch.distributed`` group (gloo) before it writes the
snapshot, and the announcement names the digest of what was sent (``broadcast_digest``). A generator that received
exactly that copies it into its model; any other (not in the group, a failed or partial receive, another digest)
loads the snapshot.

Rendezvous is a ``TCPStore`` the learner's rank 0 hosts at ``weights.broadcast.address``. Groups are formed in
rounds: the learner announces round ``r`` in the store and waits (in a thread) until its ``receivers`` have each
taken a rank; a round that does not fill within ``timeout_s`` is abandoned and the next one opened. A send is one
manifest in the store (version, names, dtypes, shapes), the tensors' bytes by ``broadcast``, the digest of what was
sent by ``broadcast``, and an ``all_reduce`` of how many receivers hold exactly that: the learner reports the digest
only when all of them do. Every operation has ``timeout_s``: a receiver that died or hangs costs the learner at most
that long once, after which the group is dropped, the update goes by the store alone, and a new round forms
with whoever joins.

Receivers stage what they receive in buffers of their own (one model's worth, reused from version to version), so
the sampler keeps sampling while the next version arrives, and its weights change only when the announcement comes.
A transformers generator is one receiver; a vLLM engine's every worker is one (``services.generator.vllm_sampler``), and
reloads in place from its buffers.

The group is gloo, so tensors travel through host memory on GPUs too (``benchmarks/gpu.py`` measures that path).
NCCL, GPU to GPU, is not built: NCCL refuses two ranks on one GPU, so it needs the learner and each generator on
GPUs of their own, and untested it would be a second transport no run could trust.
"""

from __future__ import annotations

import atexit
import json
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from common.weights import Snapshot, WeightStore, new_hasher, tensor_bytes

__all__ = ["WeightReceiver", "WeightSender", "split_address"]

log = logging.getLogger(__name__)

# Senders and receivers not yet closed. Their threads wait inside torch's C++ code; one still there when the
# interpreter finalises is unwound through a noexcept frame, and the process aborts ("terminate called without an
# active exception"). So every one is closed, and its thread joined, at exit.
_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for endpoint in list(_OPEN):
        endpoint.close()


_POLL_S = 0.02  # how often a receiver looks for the next send in the store
_DIGEST_BYTES = 128  # room for "<algorithm>:<hex>" in the digest tensor


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)``; raises ValueError naming what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host, int(port)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _listening(address: str) -> bool:
    try:
        socket.create_connection(split_address(address), timeout=1.0).close()
    except OSError:
        return False
    return True


def _store(address: str, is_master: bool, timeout_s: float) -> dist.TCPStore:
    host, port = split_address(address)
    return dist.TCPStore(host, port, None, is_master, timedelta(seconds=timeout_s), wait_for_workers=False)


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _count_holders(group, holds: bool) -> int:
    """How many ranks (the learner counting as none) hold the version just sent."""
    count = torch.tensor([int(holds)])
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    group.allreduce([count], options).wait()
    return int(count.item())


def _digest_tensor(digest: str) -> torch.Tensor:
    raw = digest.encode()
    return torch.tensor(list(raw.ljust(_DIGEST_BYTES, b"\0")), dtype=torch.uint8)


def _manifest(version: int, state: dict[str, torch.Tensor]) -> bytes:
    return json.dumps(
        {
            "version": version,
            "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in state.items()],
        }
    ).encode()


class WeightSender:
    """On the learner's rank 0: hosts the rendezvous, keeps a group of ``receivers`` generators formed, sends each
    version of the actor to it."""

    def __init__(self, address: str, receivers: int, timeout_s: float, algorithm: str):
        self.receivers, self.timeout_s, self.algorithm = receivers, timeout_s, algorithm
        try:
            self.store = _store(address, True, timeout_s)
        except (RuntimeError, OSError) as exc:
            raise RuntimeError(f"weights.broadcast.address {address}: cannot listen there: {exc}") from None
        self.address = address
        self._lock = threading.Lock()
        self._group = None  # the formed group, or None while a round is open
        self._round = 0
        self._sends = 0  # sends in the current group: the store key of the next manifest
        self._dropped = threading.Event()
        self._formed = threading.Event()
        self._ever_sent = False
        self._closed = False
        self._thread = threading.Thread(target=self._form_groups, name="weights-broadcast", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    def _form_groups(self) -> None:
        # A client of its own: forming a group holds its store connection, and send() must not wait behind it.
        store = _store(self.address, False, self.timeout_s)
        world = 1 + self.receivers
        while not self._closed:
            self._round += 1
            r = self._round
            store.set(f"r{r}/world", str(world))
            store.set("round", str(r))
            # The group is made only once every receiver holds a ticket: a group made early would wait on the store,
            # time out and start over for as long as a generator is missing.
            while not self._closed and int(store.add(f"r{r}/ticket", 0)) < self.receivers:
                time.sleep(_POLL_S)
            try:
                group = dist.ProcessGroupGloo(
                    dist.PrefixStore(f"r{r}/group/", store), 0, world, timedelta(seconds=self.timeout_s)
                )
            except RuntimeError as exc:  # a receiver took its ticket and died: the next round forms without it
                log.warning("broadcast round %d did not form (%s); opening round %d", r, _first_line(exc), r + 1)
                continue
            with self._lock:
                self._group, self._sends = group, 0
            self._formed.set()
            log.info("broadcast round %d: %d receiver(s) joined at %s", r, self.receivers, self.address)
            self._dropped.wait()
            self._dropped.clear()

    def waiting_for(self) -> str:
        """What a send would wait for, in words; empty when the group is formed."""
        if self._group is not None:
            return ""
        joined = min(int(self.store.add(f"r{self._round}/ticket", 0)), self.receivers)
        return f"{joined} of {self.receivers} broadcast receiver(s) joined round {self._round} at {self.address}"

    def send(self, version: int, state: dict[str, torch.Tensor]) -> str:
        """Send ``state`` (CPU tensors) to every receiver of the group.

        Returns:
            The digest of what was sent when every receiver holds it, else ``""`` (no group formed, a receiver gone
            or too slow, a digest that did not match): the announcement then sends everyone to the store.
        """
        if not self._ever_sent:
            # The generators start with the learner: the first version waits for them (once, at most timeout_s)
            # rather than miss the group by a second.
            self._formed.wait(self.timeout_s)
        self._ever_sent = True
        with self._lock:
            group, sends, r = self._group, self._sends, self._round
        if group is None:
            log.info("actor v%d goes by the store alone: %s", version, self.waiting_for())
            return ""
        state = {name: t.contiguous() for name, t in state.items()}
        manifest = _manifest(version, state)
        digest = new_hasher(self.algorithm)
        digest.update(manifest)
        started = time.perf_counter()
        try:
            self.store.set(f"r{r}/send/{sends}", manifest)
            for tensor in state.values():
                data = tensor_bytes(tensor)
                _broadcast(group, torch.from_numpy(data))
                digest.update(data)
            sent = f"{self.algorithm}:{digest.hexdigest()}"
            _broadcast(group, _digest_tensor(sent))
            holders = _count_holders(group, False)
        except RuntimeError as exc:
            log.warning(
                "actor v%d: broadcast failed (%s); it goes by the store, and a new group forms",
                version,
                _first_line(exc),
            )
            self._drop()
            return ""
        with self._lock:
            self._sends += 1
        if holders != self.receivers:
            log.warning(
                "actor v%d: %d of %d receivers hold the broadcast; all go by the store",
                version,
                holders,
                self.receivers,
            )
            return ""
        log.debug("actor v%d broadcast to %d receiver(s) in %.3f s", version, holders, time.perf_counter() - started)
        return sent

    def send_and_save(
        self, weights: WeightStore, name: str, version: int, state: dict[str, torch.Tensor]
    ) -> tuple[Snapshot, str]:
        """:meth:`send` ``state`` while ``weights`` writes it as snapshot ``version`` of ``name``: the announcement
        waits for both. Returns the snapshot and what :meth:`send` returns."""
        with ThreadPoolExecutor(1, thread_name_prefix="snapshot") as pool:
            writing = pool.submit(weights.save_state, name, version, state)
            sent = self.send(version, state)
            return writing.result(), sent

    def _drop(self) -> None:
        with self._lock:
            self._group = None
        self._formed.clear()
        self._dropped.set()

    def close(self) -> None:
        """Stop forming groups and release the one formed; returns once the thread has (at most ``timeout_s``)."""
        self._closed = True
        self._drop()
        self._thread.join(self.timeout_s + 1.0)
        _OPEN.discard(self)


@dataclass
class _Staged:
    version: int
    digest: str
    tensors: dict[str, torch.Tensor]


class WeightReceiver:
    """In a generator: joins the learner's broadcast group in a thread and stages each version it receives."""

    def __init__(self, address: str, timeout_s: float, algorithm: str, name: str = "generator"):
        self.address, self.timeout_s, self.algorithm, self.name = address, timeout_s, algorithm, name
        self._lock = threading.Lock()  # held while a version is received and while one is loaded
        self._staged: _Staged | None = None
        self._buffers: dict[str, torch.Tensor] = {}  # name -> uint8 buffer, reused while the layout stays
        self._closed = False
        self.received = 0  # versions received and verified
        self._thread = threading.Thread(target=self._run, name="weights-broadcast", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    def load_into(self, version: int, digest: str, load: Callable[[dict[str, torch.Tensor]], None]) -> bool:
        """Call ``load(tensors)`` with the staged tensors if they are ``version`` with ``digest``; False otherwise
        (the caller reads the store)."""
        with self._lock:
            staged = self._staged
            if staged is None or staged.version != version or staged.digest != digest:
                return False
            load(staged.tensors)
            return True

    def close(self) -> None:
        """Leave the group; returns once the thread has (at most ``timeout_s``, when a version is arriving)."""
        self._closed = True
        self._thread.join(self.timeout_s + 2.0)
        _OPEN.discard(self)

    # ------------------------------------------------------------------ the receiving thread

    def _run(self) -> None:
        said = False
        while not self._closed:
            if not _listening(self.address):  # probed first: the store's own connect retries fill the log
                if not said:
                    log.info("%s: waiting for the learner's broadcast at %s", self.name, self.address)
                    said = True
                time.sleep(1.0)
                continue
            said = False
            try:
                self._serve(_store(self.address, False, self.timeout_s))
            except (RuntimeError, ValueError) as exc:  # the learner gone, a round that failed: join again
                log.info("%s: broadcast: %s; joining again", self.name, _first_line(exc))
                time.sleep(1.0)

    def _serve(self, store: dist.TCPStore) -> None:
        while not self._closed:
            r = store.get("round")
            world = int(store.get(f"r{int(r)}/world"))
            rank = int(store.add(f"r{int(r)}/ticket", 1))
            if rank >= world:  # more receivers than the learner expects: this one reads the store
                log.warning(
                    "%s: broadcast round %s is full (%d receivers); loading from the store",
                    self.name,
                    r.decode(),
                    world - 1,
                )
                self._wait_for_round(store, r, lambda: False)
                continue
            ticket, receivers = f"r{int(r)}/ticket", world - 1
            if not self._wait_for_round(store, r, lambda: int(store.add(ticket, 0)) >= receivers):  # noqa: B023
                continue  # replaced before it filled
            group = dist.ProcessGroupGloo(
                dist.PrefixStore(f"r{int(r)}/group/", store), rank, world, timedelta(seconds=self.timeout_s)
            )
            log.info("%s: joined broadcast round %s as rank %d of %d", self.name, r.decode(), rank, world)
            sends = 0
            while not self._closed:
                key = f"r{int(r)}/send/{sends}"
                if store.check([key]):
                    self._receive(group, store.get(key))
                    sends += 1
                elif not self._wait_for_round(store, r, lambda key=key: store.check([key])):
                    break  # the learner dropped this group: join the next

    def _wait_for_round(self, store: dist.TCPStore, r: bytes, condition: Callable[[], bool]) -> bool:
        """Poll until ``condition()`` holds (True) or round ``r`` is replaced or this receiver closed (False)."""
        while not self._closed and store.get("round") == r:
            if condition():
                return True
            time.sleep(_POLL_S)
        return False

    def _receive(self, group, manifest: bytes) -> None:
        layout = json.loads(manifest)
        with self._lock:
            self._staged = None  # the buffers are being overwritten
            digest = new_hasher(self.algorithm)
            digest.update(manifest)
            tensors = {}
            for name, dtype, shape in layout["tensors"]:
                dtype = getattr(torch, dtype)
                nbytes = dtype.itemsize * int(torch.Size(shape).numel())
                buffer = self._buffers.get(name)
                if buffer is None or buffer.numel() != nbytes:
                    buffer = self._buffers[name] = torch.empty(nbytes, dtype=torch.uint8)
                _broadcast(group, buffer)
                digest.update(buffer.numpy())
                tensors[name] = buffer.view(dtype).view(shape)
            received = f"{self.algorithm}:{digest.hexdigest()}"
            sent = torch.empty(_DIGEST_BYTES, dtype=torch.uint8)
            _broadcast(group, sent)
            holds = bytes(sent.tolist()).rstrip(b"\0").decode() == received
            if holds:
                self._staged = _Staged(layout["version"], received, tensors)
                self.received += 1
            else:
                log.error(
                    "%s: broadcast of actor v%d arrived damaged; the store will be read", self.name, layout["version"]
                )
        _count_holders(group, holds)
