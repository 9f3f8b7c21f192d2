"""streamppo's entry in vLLM's weight-transfer registry, as a vLLM general plugin (``vllm.general_plugins`` in
pyproject.toml): vLLM calls :func:`register` in each of its processes, the workers included, before it builds the
engine a ``weight_transfer_config`` names. Registration is lazy (a module path), so a vLLM process that never uses
the engine imports nothing of streamppo but this file. It also quiets what vLLM's reload says of every update that
is expected (:data:`EXPECTED_ON_RELOAD`)."""

from __future__ import annotations

BACKEND = "streamppo"
# In a worker's error when weights were refused before any was touched: vLLM passes a worker's exception on as its
# message only.
REFUSED = "streamppo refused the weights, none loaded: "


# What vLLM's in-place reload says of layers a snapshot has no tensors for, each update: the rotary embedding (its
# cos/sin cache is computed, never loaded) and an LM head tied to the embedding (loaded through it). Both keep their
# tensors, and the update is right (tests/test_vllm.py: an update in place gives transformers' log-probs, on a model
# with a tied head); said at every update, it was most of a run's log and read as a failure.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
EXPECTED_ON_RELOAD = ("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights")


def _not_expected_on_reload(record) -> bool:
    return record.getMessage() not in EXPECTED_ON_RELOAD


def register() -> None:
    import logging

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
