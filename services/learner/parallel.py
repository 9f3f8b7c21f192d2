"""The learner's ranks: process groups, FSDP2 sharding, and the calls rank 0 leads.

One learner can span several processes ("ranks", one per device), started by torch's launcher (``torchrun``, or
``streamppo learner`` with ``learner.parallel.processes > 1``, which starts it). Rank 0 alone talks to Kafka; it
*leads*: every trainer call that needs all ranks (an update, a checkpoint, gathering a snapshot) is first sent to
the others over a control group, and the others, *followers*, run nothing but those calls, in the same order
(:func:`lead`, :meth:`Ranks.follow`). So every rank holds the whole experience batch, and the update is computed
over the whole mini-batch whatever the number of ranks.

Sharding is torch's own FSDP2 (``fully_shard`` on every decoder layer, then on the root), with fp32 master weights
and fp32 gradient reductions; the models' configured dtype is the compute dtype of its mixed precision.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import signal
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Ranks", "gather_full_state", "init_ranks", "lead", "shard_model"]

log = logging.getLogger(__name__)

# Followers wait on the control group for rank 0's next call, which comes when the next experience batch does:
# minutes, or hours while the pipeline is stopped. A rank that dies closes its sockets and fails the others at once;
# the launcher then restarts them all, so a long wait here never hides a failure.
_CONTROL_TIMEOUT = timedelta(days=30)
_STOP = "__stop__"


@dataclass
class Ranks:
    """This process's place among the learner's ranks. The default is the single-process learner."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    sharded: bool = False  # FSDP2 (possibly over one rank) rather than plain modules
    control: object | None = None  # the gloo group the calls travel on; None with one rank

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def send(self, call: tuple) -> None:
        if self.world_size > 1:
            dist.broadcast_object_list([call], src=0, group=self.control)

    def receive(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def follow(self, target) -> None:
        """On a follower: run the calls rank 0 leads on ``target`` until it says stop."""
        log.info("rank %d/%d: following rank 0", self.rank, self.world_size)
        while True:
            name, args, kwargs = self.receive()
            if name == _STOP:
                return
            getattr(target, name).__wrapped__(target, *args, **kwargs)

    def release(self) -> None:
        """Once, on every rank, when it is done: rank 0 tells the followers that no call will come, and each rank
        leaves the process groups (:func:`_leave_groups`)."""
        if self.world_size == 1:
            return  # a private one-rank group is shared by every trainer of the process: it stays
        if self.leads:
            try:
                self.send((_STOP, (), {}))
            except RuntimeError as exc:  # a rank is gone already: nothing to release
                log.warning("rank 0: the other ranks could not be told to stop: %s", exc)
        _leave_groups()

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def all_reduce_max(self, value: int) -> int:
        if self.world_size == 1:
            return value
        box = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return int(box)

    def gather(self, item):
        """Every rank's ``item`` as a list on rank 0 (None on the others)."""
        if self.world_size == 1:
            return [item]
        out = [None] * self.world_size if self.leads else None
        dist.gather_object(item, out, dst=0, group=self.control)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.control)


def lead(method):
    """A trainer method every rank must run: on rank 0 it is first sent to the followers (its arguments pickled
    over the control group), who run it too (:meth:`Ranks.follow`)."""

    @functools.wraps(method)
    def leading(self, *args, **kwargs):
        if self.ranks.world_size > 1 and self.ranks.leads:
            self.ranks.send((method.__name__, args, kwargs))
        return method(self, *args, **kwargs)

    return leading


def init_ranks(strategy: str, processes: int, device: str) -> Ranks:
    """Join the learner's process group (from the launcher's environment) for ``strategy: fsdp``.

    Outside a launcher, ``fsdp`` runs as one rank (a private group): useful to check a config on a laptop, and
    what a checkpoint written by N ranks is resumed with when N becomes 1. Asking for several processes outside a
    launcher is an error: ``streamppo learner`` starts them, the embedded runner cannot.
    """
    if strategy == "single":
        return Ranks(device=torch.device(device))
    if "LOCAL_RANK" not in os.environ:  # not started by torch's launcher
        if processes > 1:
            raise RuntimeError(
                f"learner.parallel.processes={processes} needs a process per rank: run `streamppo learner` (it starts "
                "them) or `streamppo up`, or torchrun across machines; `streamppo run` has one process"
            )
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            atexit.register(_leave_groups)
        return Ranks(0, 1, torch.device(device), sharded=True)
    _die_with_the_launcher()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        device, backend = f"cuda:{local}", "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
        atexit.register(_leave_groups)  # the safety net: a rank that dies by an exception skips release()
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT) if world > 1 else None
    log.info("rank %d/%d on %s (%s)", rank, world, device, backend)
    return Ranks(rank, world, torch.device(device), sharded=True, control=control)


def _leave_groups() -> None:
    """Destroy the default process group and every group made after it (the control group too), while the
    interpreter is whole. Groups left for its finalization to tear down can abort the process ("terminate called
    without an active exception": gloo's worker threads still joinable; pytorch/pytorch#190489)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _die_with_the_launcher() -> None:
    """The launcher starts each rank in a session of its own, so a supervisor that kills the launcher's process
    group (``streamppo up``, a test) would leave the ranks running, the followers waiting on rank 0 for days. On
    Linux a rank asks the kernel to kill it when its parent, the launcher, dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the launcher died before the call
            os._exit(1)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (``model.layers`` of Llama, Qwen, Mistral, ... ; ``h`` of GPT-2)."""
    for module in model.modules():
        for name in ("layers", "h", "blocks"):
            child = getattr(module, name, None)
            if isinstance(child, torch.nn.ModuleList) and len(child) > 0:
                return list(child)
    raise ValueError(f"{type(model).__name__}: no list of decoder layers found to shard")


def shard_model(model: torch.nn.Module, ranks: Ranks, compute_dtype: torch.dtype) -> torch.nn.Module:
    """FSDP2 over ``ranks``: each decoder layer is a unit (gathered for its forward, freed after), the root holds
    the rest (embeddings, head). Parameters stay float32 (the master weights); forward and backward run in
    ``compute_dtype``, gradients are reduced in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Our forward passes never change a model's output in place (sequences.py slices and copies), which is what
    # this warning, raised for every critic (a token-classification head returns a view), is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def gather_full_state(model: torch.nn.Module, ranks: Ranks) -> dict[str, torch.Tensor] | None:
    """The whole state dict on rank 0's CPU (None on the others); every rank must call it."""
    if not ranks.sharded:
        return {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if ranks.leads else None
