"""What a learner's checkpoint holds of its trainer, and how every rank writes and reads it: the models and their
optimizers (a LoRA actor's adapters alone), the KL controller, the policy version and the sampling RNG.

Single process: one ``trainer.pt``. Sharded (``learner.parallel``): every rank writes its shards with
``torch.distributed.checkpoint`` under ``shards/`` (re-shardable to any number of ranks), rank 0 the rest into
``trainer.pt``. The learner service decides when (``learner.checkpoint_every``) and what else goes with it (the
groups waiting, the ledger, the input offsets: :mod:`services.learner.service`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.storage import fsync_file
from common.weights import is_adapted, load_state_into, published_tensors

# ``trainer`` below is a services.learner.trainer.PPOTrainer (not imported: it imports this module): its models(),
# ranks, KL controller, version and sampling generator.

__all__ = ["checkpoint_nbytes", "load_trainer", "load_trainer_state", "save_trainer", "trainer_state"]


def checkpoint_nbytes(trainer) -> int:
    """What :func:`save_trainer` writes on this rank, about: weights and two Adam moments of its trained
    parameters."""
    trained = [p for _, m, _ in trainer.models() for p in m.parameters() if p.requires_grad]
    return sum(3 * t.numel() * t.element_size() for t in (getattr(p, "to_local", lambda p=p: p)() for p in trained))


def trainer_state(trainer) -> dict:
    """Everything needed to continue training exactly: weights, optimizers, KL controller, version, RNG. Single
    process only; a sharded trainer checkpoints with :func:`save_trainer`."""
    state = _small_state(trainer)
    for name, model, optimizer in trainer.models():
        # What trains: a LoRA actor's adapters alone (the base weights are the configured model's).
        weights = published_tensors(model) if is_adapted(model) else model.state_dict()
        state[name], state[f"{name}_optimizer"] = weights, optimizer.state_dict()
    return state


def load_trainer_state(trainer, state: dict) -> None:
    """Take up what :func:`trainer_state` made."""
    missing = [name for name, _, _ in trainer.models() if name not in state]
    if missing:
        raise RuntimeError(f"the checkpoint holds no {', '.join(missing)}: it was written with another estimator")
    for name, model, optimizer in trainer.models():
        if is_adapted(model):
            load_state_into(model, state[name], f"checkpoint {name}")
        else:
            model.load_state_dict(state[name])
        optimizer.load_state_dict(state[f"{name}_optimizer"])
    _load_small_state(trainer, state)


def save_trainer(trainer, folder: Path) -> None:
    """Write the trainer's state into ``folder`` (which exists), on every rank (see the module's docstring)."""
    if not trainer.ranks.sharded:
        torch.save(trainer_state(trainer), folder / "trainer.pt")
        fsync_file(folder / "trainer.pt")
        return
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(trainer), checkpoint_id=folder / "shards")
    if trainer.ranks.leads:
        torch.save(_small_state(trainer), folder / "trainer.pt")
        fsync_file(folder / "trainer.pt")


def load_trainer(trainer, folder: Path) -> None:
    """Restore what :func:`save_trainer` wrote, with any number of ranks (a sharded checkpoint is re-sharded)."""
    sharded_checkpoint = (folder / "shards").is_dir()
    if sharded_checkpoint != trainer.ranks.sharded:
        raise RuntimeError(
            f"checkpoint {folder} was written by a {'sharded' if sharded_checkpoint else 'single-process'} "
            f"learner; this one is {'sharded' if trainer.ranks.sharded else 'single-process'}. Resume it with the "
            "learner.parallel.strategy that wrote it"
        )
    state = torch.load(folder / "trainer.pt", weights_only=True)
    if not trainer.ranks.sharded:
        load_trainer_state(trainer, state)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sharded = _sharded_state(trainer)
    dcp.load(sharded, checkpoint_id=folder / "shards")
    for name, model, optimizer in trainer.models():
        set_state_dict(
            model,
            optimizer,
            model_state_dict=sharded[name],
            optim_state_dict=sharded[f"{name}_optimizer"],
        )
    _load_small_state(trainer, state)


def _small_state(trainer) -> dict:
    return {
        "kl_controller": trainer.kl_controller.state_dict(),
        "version": trainer.version,
        "generator": trainer.generator.get_state(),
    }


def _load_small_state(trainer, state: dict) -> None:
    trainer.kl_controller.load_state_dict(state["kl_controller"])
    trainer.version = int(state["version"])
    trainer.generator.set_state(state["generator"])


def _sharded_state(trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state = {}
    for name, model, optimizer in trainer.models():
        state[name], state[f"{name}_optimizer"] = get_state_dict(model, optimizer)
    return state
