"""generator: prompts → rollouts. Samples n responses per prompt with the actor and records behaviour log-probs.

A prompt batch is taken once the learner's progress allows its first group (bounded staleness counted in groups,
see :meth:`GeneratorService.ready_for`). In batch mode it is sampled whole, as one record.

With ``generation.streaming`` the generator streams: prompt batches are admitted while fewer than a batch's groups
wait; each group (a prompt's ``n`` responses) starts sampling once the bound allows it, beside whatever else is in
flight (vLLM batches them continuously; the transformers backend samples one group at a time), and goes on as soon as
its last response finishes, ``generation.groups_per_record`` of one prompt batch to a record, flushed by count or
after ``generation.flush_s``. New weights load while responses are being sampled (``generation.in_flight_updates``);
every token records the version that sampled it.

In a gateway run the generator answers the gateways' calls instead (requests → completions): each request is one
response to a whole prompt, sampled beside the others as they come, and answered as soon as it finishes. The bound on
staleness is the gateway's (it hands out episodes as the learner's progress allows).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from common.admission import Admission
from common.config import RunConfig
from common.models import load_tokenizer, resolve_model
from common.rollouts import SampledRows, rollout_batch
from common.sampling import Samples, SamplingParams
from common.schema import (
    ADAPTER_BASE,
    ADMITTED_EPOCH,
    LEARNER_GROUPS_DONE,
    Completion,
    CompletionRequest,
    PromptBatch,
    RolloutBatch,
    WeightAnnouncement,
    group_key,
    new_header,
)
from common.weights import WeightIntegrityError
from services.generator.episodes import EpisodeSampler
from services.generator.samplers import make_sampler
from services.service import Channel, Collected, InputError, Service, check_token_ids, load_announced_weights

log = logging.getLogger(__name__)

STEP_S = 0.05  # streaming: how long one collect() lets the engine run before it sends what finished
CALLS_IN_FLIGHT = 256  # a gateway run: the calls sampled at once at most (vLLM's default max_num_seqs)
# A gateway run: how long a call admitted by weights this replica has not loaded waits for them, then is answered
# with the weights it has. Far above reading and loading a snapshot; a call that names weights never announced (a
# forged one) costs that long, and never more.
ADMITTED_WEIGHTS_WAIT_S = 60.0


@dataclass
class _Stream:
    """A prompt batch being sampled group by group: the groups finished and not yet sent, and how many are unsent."""

    message: PromptBatch
    unsent: int
    finished: list[tuple[int, Samples, float]] = field(default_factory=list)  # (row, samples, when it finished)


class GeneratorService(Service):
    role = "generator"

    @classmethod
    def check_inputs(cls, config: RunConfig) -> None:
        resolve_model(config.model.actor, config.model.cache_dir)

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        super().__init__(config, replica_id)
        path = resolve_model(config.model.actor, config.model.cache_dir)
        self.tokenizer = load_tokenizer(path, config.model.trust_remote_code)
        self.sampler = make_sampler(config, path, self.tokenizer)
        log.info("%s: sampling with the %s backend", self.replica_id, self.sampler.backend)
        # With an environment each response is an episode of turns (services/generator/episodes.py).
        self.episodes = (
            EpisodeSampler(self.sampler, self.tokenizer, config, lambda: self.policy_version)
            if config.environment is not None
            else None
        )
        self.model_id = str(path)
        self.policy_version = 0  # the configured initial weights are version 0
        self.epoch = 0  # of the learner that announced the weights loaded
        self.digest = ""  # of the snapshot loaded ("": the configured initial weights)
        self.admission = Admission(config)  # bounded staleness, by the learner's progress in the announcements
        self.queue: deque[tuple[PromptBatch, int]] = deque()  # streaming: the groups admitted, not yet started
        self.sampling: dict[str, tuple[str, int]] = {}  # streaming: per group key in the engine, (batch id, row)
        self.batches: dict[str, _Stream] = {}  # streaming: the prompt batches admitted and not yet sent whole
        self.calls: dict[str, tuple[CompletionRequest, float]] = {}  # a gateway run: the calls in the engine, by
        # request key, with when each began (perf_counter)
        self.answered: list[Completion] = []  # a gateway run: answers ready to go (calls that could not be sampled)
        self.waiting_calls: dict[str, float] = {}  # a gateway run: calls waiting for the weights that admitted them
        broadcast = config.weights.broadcast
        if broadcast.address is not None:
            self.sampler.join_broadcast(broadcast.address, broadcast.timeout_s, config.weights.digest, self.replica_id)

    def on_weights(self, announcement: WeightAnnouncement) -> bool:
        mismatch = self._kind_mismatch(announcement)
        if mismatch:
            log.error("%s: keeping actor v%d: %s", self.replica_id, self.policy_version, mismatch)
            return False
        groups_done = int(
            announcement.lineage.get(LEARNER_GROUPS_DONE, announcement.policy_version * self.admission.per_update)
        )
        if self._holds(announcement):  # the learner's progress alone (groups used up without an update)
            self.admission.groups_done = max(self.admission.groups_done, groups_done)
            self.epoch = max(self.epoch, announcement.learner_epoch)
            return True
        if self.streams and not self.sampler.updates_in_flight:  # generation.in_flight_updates: finish
            while self._source.in_flight():  # the responses being sampled end under the weights that began them
                self._take_finished(self._source.step(STEP_S))
        version = announcement.policy_version
        load = functools.partial(self.sampler.load_snapshot, version=version)
        if not self._load_broadcast(announcement) and not load_announced_weights(
            load, announcement, self.replica_id, self.policy_version
        ):
            return False
        self.policy_version, self.digest = announcement.policy_version, announcement.digest
        self.epoch = announcement.learner_epoch
        self.admission.groups_done = groups_done
        return True

    @property
    def groups_done(self) -> int:
        """Groups the learner had used up when it announced the weights loaded."""
        return self.admission.groups_done

    def _holds(self, announcement: WeightAnnouncement) -> bool:
        """Whether the weights announced are the ones loaded (the initial weights are version 0's)."""
        same_version = announcement.policy_version == self.policy_version
        return same_version and (announcement.digest == self.digest or (self.policy_version == 0 and not self.digest))

    def _kind_mismatch(self, announcement: WeightAnnouncement) -> str:
        """Why the announced snapshot is not for this generator (LoRA adapters for its base, or a whole model, as it
        serves); empty when it is."""
        adapts, lora = announcement.lineage.get(ADAPTER_BASE), self.config.model.lora is not None
        if (adapts is not None) == lora and adapts in (None, self.config.model.actor):
            return ""
        made = f"LoRA adapters for {adapts}" if adapts is not None else "a whole model"
        served = f"LoRA adapters on {self.config.model.actor}" if lora else "a whole model"
        return f"the snapshot of v{announcement.policy_version} is {made}, this generator serves {served}"

    def _load_broadcast(self, announcement: WeightAnnouncement) -> bool:
        """Load the announced version from what the learner broadcast, if this replica holds exactly that."""
        if self.config.weights.broadcast.address is None or not announcement.broadcast_digest:
            return False
        version = announcement.policy_version
        try:
            loaded = self.sampler.load_broadcast(version, announcement.broadcast_digest, announcement.chain)
        except WeightIntegrityError as exc:
            log.error(
                "%s: the broadcast of actor v%d does not fit (%s); reading the store", self.replica_id, version, exc
            )
            return False
        if loaded:
            log.info("%s: actor weights v%d loaded from the broadcast", self.replica_id, version)
        return loaded

    def ready_for(self, message: PromptBatch | CompletionRequest) -> bool:
        if isinstance(message, CompletionRequest):
            # The gateway admitted the call by an announcement this replica may not have read yet (they read the
            # weights topic each on its own): answered with older weights, it would be too stale for its update.
            if self._admitted_by(message) <= (self.epoch, self.policy_version):
                self.waiting_calls.pop(message.call, None)
                return True
            since = self.waiting_calls.setdefault(message.call, time.monotonic())
            if time.monotonic() - since < ADMITTED_WEIGHTS_WAIT_S:
                return False
            del self.waiting_calls[message.call]
            epoch, version = self._admitted_by(message)
            log.warning("%s: call %s waited %.0f s for actor v%d of learner epoch %d, which the gateway admitted it by "
                        "and this replica never loaded; answered with v%d", self.replica_id, message.call,
                        ADMITTED_WEIGHTS_WAIT_S, version, epoch, self.policy_version)  # fmt: skip
            return True
        # A prompt batch is taken once its first group may be sampled (common/admission.py). Streaming then samples
        # each group only when it may; a whole batch at once may overrun the bound by its other groups, which the
        # learner drops (with dynamic sampling; otherwise the config keeps updates to whole batches).
        return self.admission.admits_batch(message.step)

    def admits(self, step: int, row: int) -> bool:
        """Whether the group of ``row`` of prompt batch ``step`` may be sampled now."""
        return self.admission.admits(step, row)

    def waiting_for(self, message: PromptBatch | CompletionRequest) -> str:
        if isinstance(message, CompletionRequest):
            epoch, version = self._admitted_by(message)
            return (
                f"actor v{version} of learner epoch {epoch}, which the gateway admitted call {message.call} by "
                f"(v{self.policy_version} of epoch {self.epoch} loaded)"
            )
        return self.admission.waiting_for(message.step, self.policy_version)

    @staticmethod
    def _admitted_by(request: CompletionRequest) -> tuple[int, int]:
        """(learner epoch, version) of the announcement the gateway admitted ``request`` by; a call of a gateway that
        does not say is answerable with any weights."""
        epoch = request.lineage.get(ADMITTED_EPOCH)
        return (int(epoch), request.policy_version) if isinstance(epoch, int) else (-1, -1)

    def process(self, message: PromptBatch) -> list[RolloutBatch]:
        self._check(message)
        return [self._rollouts(message, np.arange(message.rows), self.config.run.seed * 1_000_003 + message.step)]

    # ------------------------------------------------------------------ streaming (generation.streaming)

    @property
    def streams(self) -> bool:
        return self.config.generation.streaming

    def room(self) -> int:
        if self.config.gateway is not None:
            return CALLS_IN_FLIGHT - len(self.calls)
        # The next prompt batch is admitted while fewer than a batch's groups wait to be sampled: the engine never
        # runs dry while the bound allows more.
        return int(len(self.queue) < self.config.data.batch_size)

    def admit(self, message: PromptBatch | CompletionRequest) -> None:
        self._check(message)
        if isinstance(message, CompletionRequest):
            self._start_call(message)
            return
        # The queue stays in feed order, whatever order the prompt batches came in (from several partitions, after a
        # restart): groups start from its head as the bound allows, so a later batch's group that must wait for the
        # learner would otherwise hold back an earlier batch's that the learner waits for (a stall, under kill -9s).
        queued = [*self.queue, *((message, row) for row in range(message.rows))]
        self.queue = deque(sorted(queued, key=lambda group: (group[0].step, group[1])))
        self.batches[message.batch_id] = _Stream(message, message.rows)

    def collect(self) -> list[Collected]:
        """Start sampling the groups the bound allows, let the engine run a while, and send the groups that
        finished: up to ``generation.groups_per_record`` of one prompt batch to a record, once there are that many,
        the batch has no other group left, or the first has waited ``generation.flush_s``."""
        self._start_admissible()
        if self._source.in_flight():
            self._take_finished(self._source.step(STEP_S))
        answers, self.answered = self.answered, []
        return [Collected(answer.batch_id, [answer], True) for answer in answers] + self._flush(time.monotonic())

    def under_way(self) -> bool:
        return (
            self._source.in_flight() > 0
            or bool(self.answered)
            or any(stream.finished for stream in self.batches.values())
        )

    def channels(self) -> dict[str, tuple[str, str]]:
        env = self.config.environment
        return {"environment": ("turns", "observations")} if env is not None and env.placement == "bus" else {}

    def connect(self, channels: dict[str, Channel]) -> None:
        self.episodes.connect(channels["environment"], self.replica_id)

    @property
    def _source(self):
        """What samples the groups: the episodes, or the sampler itself."""
        return self.episodes or self.sampler

    def _start_admissible(self) -> None:
        while self.queue and self.admits(self.queue[0][0].step, self.queue[0][1]):
            message, row = self.queue.popleft()
            key = group_key(message.step, row)
            self.sampling[key] = (message.batch_id, row)
            prompt = message.prompt_tokens[row, : int(message.prompt_lengths[row])].tolist()
            params = self._params(self._group_seed(message.step, row))
            if self.episodes is not None:
                self.episodes.submit(key, prompt, params, message, row)
            else:
                self.sampler.submit(key, prompt, params)

    def _start_call(self, request: CompletionRequest) -> None:
        """Start sampling one call's response (an answer that it cannot be sampled, for a prompt the engine refuses)."""
        key = request.idempotency_keys()[0]
        params = SamplingParams(
            n=1,
            max_new_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed if request.seed >= 0 else None,
            stop=tuple(request.stop),
        )
        try:
            self.sampler.submit(key, request.prompt_tokens.tolist(), params)
        except ValueError as exc:  # vLLM refuses a prompt (and max_tokens) past the model's length at once
            log.warning("%s: call %s cannot be sampled: %s", self.replica_id, request.call, exc)
            self.answered.append(self._completion(request, None, 0.0, f"cannot be sampled: {exc}".splitlines()[0]))
            return
        self.calls[key] = (request, time.perf_counter())

    def _completion(
        self, request: CompletionRequest, samples: Samples | None, seconds: float, status: str = "ok"
    ) -> Completion:
        """The answer to ``request``: the response in ``samples`` (None: an error, said by ``status``), sampled in
        ``seconds`` (from taking the request to its last token)."""
        length = int(samples.response_lengths[0]) if samples is not None else 0
        tokens = samples.response_tokens[0, :length].numpy() if samples is not None else np.zeros(0, np.int64)
        if samples is not None and samples.token_versions is not None:
            versions = samples.token_versions[0, :length].numpy().astype(np.int32)
        else:
            versions = np.full(length, self.policy_version, dtype=np.int32)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        stops = [text.find(stop) for stop in request.stop if stop in text]
        if samples is None:
            finish = "error"
        else:
            finish = "stop" if stops or bool(samples.finished[0]) else "length"
        return Completion(
            **new_header(
                request.batch_id,
                self.replica_id,
                int(versions.min()) if length else self.policy_version,
                {
                    **request.lineage,
                    "generator.backend": self.sampler.backend,
                    "generator.replica": self.replica_id,
                    "generator.seconds": round(seconds, 4),
                    "actor.model": self.model_id,
                },
            ),
            step=request.step,
            episode=request.episode,
            call=request.call,
            reply_to=request.reply_to,
            response_tokens=tokens.astype(np.int64),
            behaviour_logprobs=(
                samples.behaviour_logprobs[0, :length].numpy() if samples is not None else np.zeros(0, np.float32)
            ),
            token_versions=versions,
            text=text[: min(stops)] if stops else text,  # as OpenAI answers: the stop string is not part of it
            finish_reason=finish,
            status=status,
        )

    def _take_finished(self, finished: list[tuple[str, Samples]]) -> None:
        for key, samples in finished:
            if key in self.calls:
                request, started = self.calls.pop(key)
                self.answered.append(self._completion(request, samples, time.perf_counter() - started))
                continue
            batch_id, row = self.sampling.pop(key)
            if samples.token_versions is None:  # sampled whole, by the weights loaded now
                samples = dataclasses.replace(samples, token_versions=samples.labelled(self.policy_version))
            self.batches[batch_id].finished.append((row, samples, time.monotonic()))

    def _flush(self, now: float) -> list[Collected]:
        out = []
        per_record, wait = self.config.generation.groups_per_record, self.config.generation.flush_s
        for batch_id, stream in list(self.batches.items()):
            while stream.finished and (
                len(stream.finished) >= per_record
                or len(stream.finished) == stream.unsent
                or now - stream.finished[0][2] >= wait
            ):
                taken, stream.finished = stream.finished[:per_record], stream.finished[per_record:]
                stream.unsent -= len(taken)
                out.append(Collected(batch_id, [self._record(stream.message, taken)], stream.unsent == 0))
            if stream.unsent == 0:
                del self.batches[batch_id]
        return out

    def _record(self, message: PromptBatch, groups: list[tuple[int, Samples, float]]) -> RolloutBatch:
        """The record of finished groups (rows of ``message``), each labelled with the versions that sampled it."""
        rows = np.array([row for row, _, _ in groups])
        samples = Samples.concat([samples for _, samples, _ in groups])
        params = self._params(self._group_seed(message.step, int(rows[0])))
        batch_id, lineage = f"{message.batch_id}/{rows[0]}-{rows[-1]}", self._lineage(message, params)
        return self._rollout_batch(message, rows, samples, batch_id, self.policy_version, lineage)

    # ------------------------------------------------------------------ internals

    def _check(self, message: PromptBatch | CompletionRequest) -> None:
        if not 0 <= message.step < self.config.steps_possible:
            raise InputError(
                f"step {message.step} is outside the run's prompt batches 0..{self.config.steps_possible - 1}"
            )
        check_token_ids(message, self.sampler.skeleton, "actor")

    def _rollouts(self, message: PromptBatch, prompts: np.ndarray, seed: int) -> RolloutBatch:
        """The groups of ``prompts`` (rows of the prompt batch), sampled together by the weights loaded now."""
        params = self._params(seed)
        if self.episodes is not None:
            samples = self.episodes.sample(message, prompts, params)
        else:
            tokens, lengths = message.prompt_tokens[prompts], message.prompt_lengths[prompts]
            samples = self.sampler.sample(torch.from_numpy(tokens), torch.from_numpy(lengths), params)
        lineage = self._lineage(message, params)
        return self._rollout_batch(message, prompts, samples, message.batch_id, self.policy_version, lineage)

    def _params(self, seed: int) -> SamplingParams:
        gen = self.config.generation
        return SamplingParams(
            n=gen.n,
            max_new_tokens=gen.max_new_tokens,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            seed=seed,
        )

    def _group_seed(self, step: int, row: int) -> int:
        """A streamed group's seed: its samples are the same whichever groups it was sampled beside."""
        return (self.config.run.seed * 1_000_003 + step) * 1_009 + row

    def _lineage(self, message: PromptBatch, params: SamplingParams) -> dict:
        return {
            **message.lineage,
            **params.lineage(),
            "generator.backend": self.sampler.backend,
            "generator.replica": self.replica_id,
            "actor.model": self.model_id,
        }

    def _rollout_batch(
        self, message: PromptBatch, prompts: np.ndarray, samples, batch_id: str, version: int, lineage: dict
    ) -> RolloutBatch:
        """The record of ``samples`` of the groups of ``prompts`` (rows of the prompt batch)."""
        rows = prompts[samples.group_index.numpy()]
        versions = samples.token_versions if samples.token_versions is not None else samples.labelled(version)
        sampled = SampledRows(
            group_index=rows,
            prompt_tokens=message.prompt_tokens[rows],
            prompt_lengths=message.prompt_lengths[rows],
            response_tokens=samples.response_tokens.numpy(),
            response_lengths=samples.response_lengths.numpy(),
            response_text=self.tokenizer.batch_decode(samples.response_tokens, skip_special_tokens=True),
            finished=samples.finished.numpy(),
            behaviour_logprobs=samples.behaviour_logprobs.numpy(),
            token_versions=versions.numpy(),
            response_mask=samples.models().numpy(),
            turns=samples.turn_counts().numpy(),
            environment_reward=samples.environment_rewards().numpy(),
        )
        return rollout_batch(message, sampled, batch_id, self.replica_id, lineage, version)

    def take_up_new_log(self) -> bool:
        """The groups and calls in flight are dropped (the feeder publishes their prompt batches again; an agent calls
        again); the weights loaded stay, and with them the learner's progress they were announced with: the learner
        goes on from its state then, never from before it."""
        if self.episodes is not None:
            return False  # episodes talk to environments over a channel of the old log: started again
        self.sampler.abort([*self.sampling, *self.calls])
        self.queue.clear()
        self.sampling.clear()
        self.batches.clear()
        self.calls.clear()
        self.answered.clear()
        return True

    def close(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
        self.sampler.close()
