"""A trained model's tensors as a snapshot takes them, on every rank of a learner: the whole state gathered to rank 0
(:func:`full_state`), or each rank's part of a sharded snapshot written in parallel (:func:`write_parts`). The
learner service writes and announces them (:mod:`common.weights` holds the store and its files)."""

from __future__ import annotations

import torch

from common.weights import first_names, is_adapted, part_name, plan_parts, published_tensors, write_part
from services.learner.parallel import Ranks, gather_full_state

__all__ = ["full_state", "write_parts"]


def full_state(module: torch.nn.Module, ranks: Ranks, dtype: str = "float32") -> dict[str, torch.Tensor] | None:
    """The whole state of ``module`` in ``dtype`` on rank 0's CPU (None on the other ranks), each tied tensor once,
    under its first name (as a transformers checkpoint has it); a LoRA actor's adapters alone."""
    target = getattr(torch, dtype)
    if is_adapted(module):  # one process (config): the adapters are the snapshot
        return {name: t.detach().cpu().to(target).contiguous() for name, t in published_tensors(module).items()}
    state = gather_full_state(module, ranks)
    if state is None:
        return None
    return {
        name: (tensor.to(target) if tensor.is_floating_point() else tensor).contiguous()
        for name, tensor in state.items()
        if name in first_names(module)
    }


def write_parts(module: torch.nn.Module, ranks: Ranks, dtype: str, folder: str, digest: str) -> list | None:
    """Every rank writes its part of a sharded snapshot of ``module`` into ``folder`` (in parallel); rank 0 returns
    ``[(file name, digest, {tensor: shape}), ...]`` of all parts (None on the others).

    Tensors are dealt to the ranks by :func:`common.weights.plan_parts`, the same way on every rank. Each is gathered
    whole (``full_tensor``, a collective every rank joins, in one order) and kept by its owner only: the traffic of
    gathering the state to rank 0, and no rank holds more than its part plus the one tensor in flight.
    """
    state = module.state_dict()
    names = sorted(first_names(module))  # one order on every rank
    world, rank = ranks.world_size, ranks.rank
    owner = plan_parts({n: state[n].numel() * state[n].element_size() for n in names}, world)
    target, mine = getattr(torch, dtype), {}
    for name in names:
        tensor = state[name]
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        if owner[name] == rank:
            whole = whole.detach().cpu()
            mine[name] = (whole.to(target) if whole.is_floating_point() else whole).contiguous()
    part = part_name(rank, world)
    written = (part, write_part(folder, part, mine, digest), {n: tuple(t.shape) for n, t in mine.items()})
    return ranks.gather(written)
