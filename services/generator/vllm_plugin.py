"""streamppo's entry in vLLM's weight-transfer registry, as a vLLM general plugin (``vllm.general_plugins`` in
pyproject.toml): vLLM calls :func:`register` in each of its processes, the workers included, before it builds the
engine a ``weight_transfer_config`` names. Registration is lazy (a module path), so a vLLM process that never uses
the engine imports nothing of streamppo but this file."""

from __future__ import annotations

BACKEND = "streamppo"
# In a worker's error when weights were refused before any was touched: vLLM passes a worker's exception on as its
# message only.
REFUSED = "streamppo refused the weights, none loaded: "


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "services.generator.vllm_transfer", "StoreWeightTransferEngine"
        )
    except ValueError:  # vLLM may call a plugin more than once in a process
        pass
