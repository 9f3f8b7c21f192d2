"""streamppo's weight-transfer engine for vLLM (registered as ``streamppo`` by :mod:`services.generator.vllm_plugin`).

It runs in each engine worker and takes the weights the learner announced by one of streamppo's two paths: a
snapshot chain in the weight store (``update_info = {"chain": [...]}``: mapped in the worker, checked against its
digests, its tensors views of the file's pages) or the learner's broadcast (``init_info = {"broadcast": [address,
timeout_s, algorithm, name]}`` joins it; ``update_info = {"version": v, "digest": d}`` loads the staged tensors if
they are that version). Either way the tensors go through vLLM's own in-place reload, all of it inside
``update_weights``, as the tensors are views that live only while the snapshot is open; ``start_weight_update`` and
``finish_weight_update`` have nothing to do.

Weights that are refused (a digest that does not match, a broadcast that did not arrive) are refused before any
weight is touched: ``update_weights`` raises with :data:`REFUSED` in its message, and the engine keeps the weights
it had.

A vLLM server started with ``--weight-transfer-config '{"backend": "streamppo"}'`` takes streamppo's snapshots by
its own weight-update routes the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from common.weights import WeightIntegrityError, open_weights
from services.generator.vllm_plugin import REFUSED


@dataclass
class StoreInitInfo(WeightTransferInitInfo):
    broadcast: list | None = None  # WeightReceiver's arguments: address, timeout_s, algorithm, name


@dataclass
class StoreUpdateInfo(WeightTransferUpdateInfo):
    chain: list[str] | None = None  # a snapshot chain in the store ("<digest> <uri>", full snapshot first)
    version: int | None = None  # or the version and digest of a broadcast
    digest: str | None = None


class StoreWeightTransferEngine(WeightTransferEngine[StoreInitInfo, StoreUpdateInfo]):
    init_info_cls = StoreInitInfo
    update_info_cls = StoreUpdateInfo
    supports_draft_weight_update = False

    receiver = None  # common.broadcast.WeightReceiver, once the learner's broadcast is joined

    def init_transfer_engine(self, init_info: StoreInitInfo) -> None:
        if init_info.broadcast is not None:
            from common.broadcast import WeightReceiver

            if self.receiver is not None:
                self.receiver.close()
            self.receiver = WeightReceiver(*init_info.broadcast)

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: StoreUpdateInfo) -> None:
        if update_info.chain is not None:
            try:
                with open_weights(update_info.chain) as state:  # every link verified before a tensor is returned
                    self._reload(state)
            except WeightIntegrityError as exc:
                raise RuntimeError(REFUSED + str(exc)) from exc
            return
        if self.receiver is None or not self.receiver.load_into(update_info.version, update_info.digest, self._reload):
            raise RuntimeError(REFUSED + f"broadcast of v{update_info.version} did not arrive in this worker")

    def _reload(self, state: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(self.vllm_config, self.model, iter(state.items()), None, is_checkpoint_format=True)
        _repack_tied_cpu_linears(self.model)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


def _repack_tied_cpu_linears(model: torch.nn.Module) -> None:
    """Re-pack linears whose weight is tied to a reloaded one (vLLM CPU, tied embeddings).

    On CPU, vLLM packs each linear's weight for oneDNN once, after loading. The in-place reload re-packs the layers
    it loaded, but an ``lm_head`` tied to ``embed_tokens`` receives no tensor of its own: its weight is updated
    through the tie, its packed copy is not, and the logits keep coming from the old embedding. Layers that keep
    their weight next to the packed copy (embeddings; packed linears drop theirs) are re-packed from it here.
    """
    for module in model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if hasattr(module, "cpu_linear") and method is not None and weight is not None and weight.numel() > 0:
            method.process_weights_after_loading(module)
