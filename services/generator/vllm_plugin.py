"""streamppo's entry in vLLM's weight-transfer registry, as a vLLM general plugin (``vllm.general_plugins`` in
pyproject.toml): vLLM calls :func:`register` in each of its processes, the workers included, before it builds the
engine a ``weight_transfer_config`` names. Registration is lazy (a module path), so a vLLM process that never uses
the engine imports nothing of streamppo but this file. It also quiets what vLLM's reload says of every update that
is expected (:data:`EXPECTED_ON_RELOAD`), and makes each process vLLM starts die with the process that started it
(:func:`die_with_parent`)."""

from __future__ import annotations

import os
import signal
import threading
import time

BACKEND = "streamppo"
# In a worker's error when weights were refused before any was touched: vLLM passes a worker's exception on as its
# message only.
REFUSED = "streamppo refused the weights, none loaded: "


# What vLLM's in-place reload says of layers a snapshot has no tensors for, each update: the rotary embedding (its
# cos/sin cache is computed, never loaded) and an LM head tied to the embedding (loaded through it). Both keep their
# tensors, and the update is right (tests/services/generator/test_vllm.py: an update in place gives transformers'
# log-probs, on a model with a tied head); said at every update, it was most of a run's log and read as a failure.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
EXPECTED_ON_RELOAD = ("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights")


def _not_expected_on_reload(record) -> bool:
    return record.getMessage() not in EXPECTED_ON_RELOAD


PARENT_CHECK_S = 0.5  # how often a vLLM process looks for its parent


def die_with_parent() -> None:
    """In a process vLLM started (its engine core, its workers): a watchdog that kills this process once the one
    that started it is gone. A generator killed by ``kill -9`` or the OOM killer cannot stop its engine, whose
    processes then ran on with parent 1, holding gigabytes and the dead run's stdout (a pipe on it never ended).
    Each of vLLM's processes watches its own parent, so a worker goes with its engine core. Not in the process that
    hosts vLLM itself (not started by multiprocessing), nor twice in one process."""
    import multiprocessing

    if multiprocessing.parent_process() is None or getattr(die_with_parent, "watching", False):
        return
    die_with_parent.watching = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os.kill(os.getpid(), signal.SIGKILL)  # nothing of it is worth keeping: its host, and its requests, are gone

    threading.Thread(target=watch, name="streamppo-die-with-parent", daemon=True).start()


def _quiet_deprecated_reduce_op() -> None:
    """vLLM's CPU kernel overrides scan every attribute of every module loaded (``hasattr(value, "__dict__")``), and
    reading ``torch.distributed.reduce_op``, a deprecated enum, warns. PYTHONWARNINGS ignores FutureWarnings, but
    torch's own ``catch_warnings(); simplefilter("always")`` in another thread swaps the filters for a moment (they
    are one global list), and under load the warning reached a user's run. Reading it no longer warns; its values are
    torch.distributed.ReduceOp's, as they were."""
    import torch.distributed.distributed_c10d as c10d

    deprecated = getattr(c10d, "_reduce_op", None)
    if deprecated is not None:
        deprecated.__getattribute__ = object.__getattribute__


def register() -> None:
    import logging

    die_with_parent()
    _quiet_deprecated_reduce_op()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    reload_log = logging.getLogger(RELOAD_LOGGER)
    if _not_expected_on_reload not in reload_log.filters:
        reload_log.addFilter(_not_expected_on_reload)

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "services.generator.vllm_transfer", "StoreWeightTransferEngine"
        )
    except ValueError:  # vLLM may call a plugin more than once in a process
        pass
