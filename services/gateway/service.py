"""gateway: prompts → rollouts, through agents you already have. An OpenAI-compatible HTTP API serves each episode's
calls from the generator fleet, and every call is written to the log before it is answered.

A prompt batch's groups are offered as episodes (``n`` per prompt) as the bound on staleness allows (as the generator
starts groups); an agent takes one (``POST /episodes/claim``, or the run's own agent threads, ``gateway.agent``) and
talks to the model at the episode's base URL with any OpenAI client. Each call:

1. its prompt is built from the request (a chat rendered with the model's template), reusing the episode's earlier
   tokens exactly where it extends an earlier call (:mod:`.conversation`);
2. it goes to the generators on ``requests`` (the run's sampling settings), and their answer comes on ``completions``;
3. the call (prompt tokens after its parent's, sampled tokens, behaviour log-probs, versions) is written to the
   ``episodes`` log, and only then answered.

Rewards and ends are events of the same log. The replica that holds the prompt batch turns each group into a
rollouts record once all of its episodes have ended (:mod:`.episodes`: one row per chain of calls); an episode that
ended without a reward is trained, scored or dead-lettered as ``gateway.unrewarded`` says, and counted. Any replica
serves any episode: each reads the whole log (the episodes it learns of from others' events), and reads it to its end
before it decides that a call extends nothing, that a retried call is new, or that an episode does not exist, where
another replica may have written what it has not read yet.

Weights are never waited for: the generators load new ones while calls are sampled, every token labelled with the
version that sampled it, and no call is refused or held for an update.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
from transformers import AutoConfig

from common.admission import Admission
from common.config import RunConfig
from common.models import load_tokenizer, resolve_model
from common.schema import (
    LEARNER_GROUPS_DONE,
    RUN_ID,
    Completion,
    CompletionRequest,
    EpisodeEvent,
    PromptBatch,
    RolloutBatch,
    WeightAnnouncement,
    new_header,
)
from services.gateway.api import MAX_REWARD, Answer, ApiError, now
from services.gateway.conversation import Prompt, Prompts, append_only_violation
from services.gateway.episodes import Episode, EpisodeBook, KeyError_, Row, episode_id, episode_key, episode_of_key
from services.gateway.http import GatewayServer, Request
from services.service import Channel, Collected, InputError, Service

log = logging.getLogger(__name__)

__all__ = ["GatewayService"]

WAIT_S = 0.005  # how long one collect() waits for a request: what an answer may wait to be read, at most
CATCH_UP_S = 5.0  # the longest the loop reads the episodes log to its end for one request
IDLE_SAY_S = 30.0  # episodes offered and not taken for this long: say so


@dataclass
class _Pending:
    """A call sent to the generators. Its clients wait for the answer; one that waits past gateway.call_timeout_s is
    told to try again, and the call goes on: a retry waits for the same answer (never a second sample), which is
    written to the log once someone waits for it (an answer nobody asks for again is never trained)."""

    episode: str
    call: str
    prompt: Prompt
    request_digest: str
    messages: int  # the chat's messages (0: a prompt of the completions API)
    waiting: list[Request] = field(default_factory=list)
    completion: Completion | None = None  # the generators' answer, while nobody waits for it


@dataclass
class _Batch:
    """A prompt batch held: its groups not yet sent (rows), and those not yet offered."""

    message: PromptBatch
    open_rows: set[int]
    unoffered: deque[int]


class GatewayService(Service):
    role = "gateway"

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        super().__init__(config, replica_id)
        self.gateway = config.gateway
        path = resolve_model(config.model.actor, config.model.cache_dir)
        self.tokenizer = load_tokenizer(path, config.model.trust_remote_code)
        self.prompts = Prompts(self.tokenizer)
        self.model_name = self.gateway.model_name or path.name
        self.model_id = str(path)
        self.context = _context_length(path, config)
        self.template_problem = append_only_violation(self.tokenizer)
        if self.template_problem:
            log.warning("%s: %s", self.replica_id, self.template_problem)
        self.secret = config.signing_key()
        self.book = EpisodeBook(self.tokenizer)
        self.admission = Admission(config)
        self.policy_version = 0
        self.reply_to = f"{self.replica_id}/{uuid.uuid4().hex[:12]}"
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.batches: dict[str, _Batch] = {}
        self.offers: deque[str] = deque()  # episodes of the batches held, to be taken
        self.claims: list[Request] = []  # agents waiting for an episode
        self.pending: dict[str, _Pending] = {}  # calls at the generators, by call id
        self.peers: set[str] = set()  # other replicas that wrote to the episodes log
        self.counts: Counter[str] = Counter()
        self.offered_since: float | None = None  # when the oldest offer not taken was made
        self.said_idle = 0.0
        self.server: GatewayServer | None = None
        self.agents = None  # the run's own agents (gateway.agent, placement local)
        self.sampling: Channel | None = None
        self.log: Channel | None = None

    # ------------------------------------------------------------------ lifecycle

    def channels(self) -> dict[str, tuple[str, str]]:
        return {"sampling": ("requests", "completions"), "episodes": ("episodes", "episodes")}

    def connect(self, channels: dict[str, Channel]) -> None:
        self.sampling, self.log = channels["sampling"], channels["episodes"]

    def start(self) -> list:
        # Everything the log holds first (a replica that starts again knows every episode before it answers).
        self._catch_up()
        self.server = GatewayServer(
            self.gateway.host,
            self.gateway.port,
            self.inbox,
            self.model_name,
            self.gateway.max_request_bytes,
            self.gateway.call_timeout_s + 30.0,
            self._health,
        )
        self.server.start()
        # Said on stdout, not as a log record: the address is what a user needs first (`up` shows it without -v).
        print(f"{self.replica_id} serving the OpenAI API on {self.url} (model {self.model_name!r})", flush=True)
        agent = self.gateway.agent
        if agent is not None and agent.placement == "local":
            from services.gateway.agents import AgentPool

            self.agents = AgentPool(agent.function, [self.url], agent.workers, name=self.replica_id)
            self.agents.start()
        return []

    @property
    def url(self) -> str:
        if self.gateway.public_url:
            return self.gateway.public_url.rstrip("/")
        host = "127.0.0.1" if self.gateway.host in ("0.0.0.0", "::", "") else self.gateway.host
        return f"http://{host}:{self.server.port}"

    def close(self) -> None:
        # What waits is answered first (retryable: another replica, or this one restarted, serves it), so that the
        # server stops without waiting on its handlers, and the agents' threads stop with it.
        if self.agents is not None:
            self.agents.stopping.set()
        stopping = ApiError(503, "the gateway is stopping; try again", "stopping")
        for request in self._waiting():
            request.answer(stopping)
        while not self.inbox.empty():
            self.inbox.get_nowait().answer(stopping)
        if self.server is not None:
            self.server.stop()
        if self.agents is not None:
            self.agents.stop()

    def on_weights(self, announcement: WeightAnnouncement) -> bool:
        # Nothing to load: the learner's progress (for the bound) and the version (for the status) are what count.
        self.policy_version = max(self.policy_version, announcement.policy_version)
        done = int(
            announcement.lineage.get(LEARNER_GROUPS_DONE, announcement.policy_version * self.admission.per_update)
        )
        self.admission.groups_done = done
        self._forget_used_up()
        return True

    def ready_for(self, message: PromptBatch) -> bool:
        return self.admission.admits_batch(message.step)

    def waiting_for(self, message: PromptBatch) -> str:
        return self.admission.waiting_for(message.step, self.policy_version)

    def process(self, message: PromptBatch) -> list:
        raise NotImplementedError("the gateway streams (generation.streaming)")

    @property
    def streams(self) -> bool:
        return True

    def room(self) -> int:
        # The next prompt batch is taken while fewer than a batch's episodes wait to be taken, and every group held
        # has been offered (the others wait for the bound).
        few = len(self.offers) < self.config.data.batch_size * self.config.generation.n
        return int(few and not any(batch.unoffered for batch in self.batches.values()))

    def admit(self, message: PromptBatch) -> None:
        if not 0 <= message.step < self.config.steps_possible:
            raise InputError(
                f"step {message.step} is outside the run's prompt batches 0..{self.config.steps_possible - 1}"
            )
        self.batches[message.batch_id] = _Batch(message, set(range(message.rows)), deque(range(message.rows)))

    def under_way(self) -> bool:
        return bool(self.batches or self.pending)

    def collect(self) -> list[Collected]:
        """One round of the loop: the log and the generators' answers read, requests served, episodes offered, what
        timed out ended, and the groups whose episodes have all ended sent."""
        self._read_log()
        self._read_answers()
        self._serve(WAIT_S)  # a short wait for requests paces the loop: with calls at the generators it spun at a core
        self._offer()
        self._expire()
        return self._settle()

    # ------------------------------------------------------------------ the log

    def _read_log(self) -> None:
        for event in self.log.receive():
            if event.producer != self.replica_id:
                self.peers.add(event.producer)
            self.book.apply(event, logged=True)
        for why in self.book.refused:
            self.counts["rewards_refused"] += 1
            log.warning("%s: a reward on the episodes log is left out: %s", self.replica_id, why)
        self.book.refused.clear()

    def _catch_up(self) -> None:
        """Read the episodes log to its end (what other replicas wrote before now)."""
        deadline = time.monotonic() + CATCH_UP_S
        while not self.log.caught_up() and time.monotonic() < deadline:
            self._read_log()
        self._read_log()

    def _read_on_for(self, request: Request) -> bool:
        """Read the episodes log to its end for ``request``, once, where other replicas write to it (what it needs
        may be there, not read yet); whether it did."""
        if not self.peers or request.caught_up:
            return False
        self._catch_up()
        request.caught_up = True
        return True

    def _write(self, event: EpisodeEvent) -> Episode:
        self.log.send(event)  # acknowledged by the broker: on the log before anyone is answered
        return self.book.apply(event, logged=False) or self.book.get(event.episode)

    def _event(
        self,
        episode: Episode,
        kind: str,
        event_id: str,
        version: int | None = None,
        lineage: dict | None = None,
        **fields,
    ) -> EpisodeEvent:
        empty = {
            "parent": "",
            "request_digest": "",
            "messages": 0,
            "prompt_text": "",
            "prompt_tokens": np.zeros(0, np.int64),
            "response_tokens": np.zeros(0, np.int64),
            "behaviour_logprobs": np.zeros(0, np.float32),
            "token_versions": np.zeros(0, np.int32),
            "text": "",
            "finish_reason": "",
            "reward": 0.0,
            "outcome": "",
            "detail": "",
        }
        lineage = {**self._origin(episode).lineage, **(lineage or {}), "gateway.replica": self.replica_id}
        return EpisodeEvent(
            **new_header(
                episode.batch_id, self.replica_id, self.policy_version if version is None else version, lineage
            ),
            step=episode.step,
            episode=episode.id,
            kind=kind,
            event=event_id,
            **(empty | fields),
        )

    def _origin(self, episode: Episode) -> PromptBatch | _Origin:
        batch = self.batches.get(episode.batch_id)
        return batch.message if batch is not None else _Origin({RUN_ID: self.run_id})

    # ------------------------------------------------------------------ requests

    def _serve(self, wait_s: float) -> None:
        try:
            requests = [self.inbox.get(timeout=wait_s) if wait_s else self.inbox.get_nowait()]
        except queue.Empty:
            return
        while True:
            try:
                requests.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        handlers = {"chat": self._call, "completion": self._call, "claim": self._claim, "reward": self._reward,
                    "end": self._end}  # fmt: skip
        for position, request in enumerate(requests):
            try:
                handlers[request.kind](request)
            except ApiError as exc:
                request.answer(exc)
            except Exception:  # the broker away (the runner retries), or a fault: nobody is left waiting on it
                for unserved in requests[position:]:
                    unserved.answer(ApiError(503, "the gateway cannot serve this now; try again", "unavailable"))
                raise

    def _episode(self, request: Request) -> Episode:
        """The episode the request's key names (taken, or offered here), read from the log to its end first if this
        replica does not know it; 401 for a key that is not one, 404 for an episode not (yet) handed out, 409 for
        one that has ended."""
        try:
            name = episode_of_key(request.key, self.secret)
        except KeyError_ as exc:
            raise ApiError(401, str(exc), "invalid_api_key") from None
        episode = self.book.get(name)
        unknown = episode is None or not episode.started
        if unknown and name not in self.book.gone and self._read_on_for(request):  # another replica handed it out?
            episode = self.book.get(name)
        if name in self.book.gone or (episode is not None and episode.over):
            raise ApiError(409, f"episode {name} has ended", "episode_ended")
        if episode is None or (not episode.started and episode.id not in self.offers):
            raise ApiError(404, f"episode {name} is not one this run has handed out", "episode_not_found")
        return episode

    def _call(self, request: Request) -> None:
        episode = self._episode(request)
        body = request.body
        if body.model != self.model_name:
            raise ApiError(
                404,
                f"the model {body.model!r} is not served here: the gateway serves {self.model_name!r}",
                "model_not_found",
                "model",
            )
        if not episode.started:  # its base URL used before a claim (an agent given it by other means): taken now
            self._take(episode, "first call")
        digest = _digest(body)
        call_id = self._call_id(episode, request, digest)
        if call_id in episode.calls:  # a retry of a call answered before: the same answer
            self.counts["retries_answered"] += 1
            request.answer(self._answer(episode.calls[call_id].event))
            return
        if call_id in self.pending:
            self.pending[call_id].waiting.append(request)
            self._deliver(self.pending[call_id])
            return
        # Calls at the generators count too: 200 parallel calls to one episode all came before any was answered.
        in_flight = sum(1 for pending in self.pending.values() if pending.episode == episode.id)
        if len(episode.calls) + in_flight >= self.gateway.max_calls:
            raise ApiError(
                400, f"episode {episode.id} has had its {self.gateway.max_calls} calls (gateway.max_calls)", "max_calls"
            )
        prompt = self._prompt(request, episode)
        if not prompt.parent and episode.calls and self._read_on_for(request):
            self._call(request)  # it may extend a call another replica answered, not read here before
            return
        max_tokens = self._max_tokens(body.limit, prompt)
        if not prompt.parent and episode.calls:
            self.counts["splits"] += 1  # a new row of the episode (see episodes.py)
        self.sampling.send(
            CompletionRequest(
                **new_header(call_id, self.replica_id, self.policy_version, self._origin(episode).lineage),
                step=episode.step,
                episode=episode.id,
                call=call_id,
                reply_to=self.reply_to,
                prompt_tokens=np.asarray(prompt.tokens, np.int64),
                max_tokens=max_tokens,
                temperature=self.config.generation.temperature,
                top_p=self.config.generation.top_p,
                top_k=self.config.generation.top_k,
                # Unseeded unless the client asks: a call is sampled once (a retry gets its answer), and seeded
                # requests crashed vLLM for CPUs 0.32 under 128 concurrent calls (it rewinds a request's generator
                # after a split prefill, which a CPU generator cannot: benchmarks/RESULTS.md, section 15).
                seed=body.seed if body.seed is not None and body.seed >= 0 else -1,
                stop=body.stops,
            )
        )
        messages = len(body.messages) if request.kind == "chat" else 0
        self.pending[call_id] = _Pending(episode.id, call_id, prompt, digest, messages, [request])
        episode.active = time.monotonic()

    def _call_id(self, episode: Episode, request: Request, digest: str) -> str:
        """The call's id: the client's idempotency key's, or for a client's retry (x-stainless-retry-count) of a call
        answered before, that call's (same request, the newest); else a new one."""
        if request.idempotency_key:
            call_id = f"{episode.id}/k{_key_hash(request.idempotency_key)}"
            if call_id not in episode.calls and call_id not in self.pending:
                self._read_on_for(request)  # another replica may have answered it
            return call_id
        if request.retries:
            self._read_on_for(request)  # another replica may have answered it
            same = [call for call in episode.calls.values() if call.event.request_digest == digest]
            waiting = [p.call for p in self.pending.values() if p.episode == episode.id and p.request_digest == digest]
            if waiting or same:
                return (waiting or [same[-1].id])[-1]
        return f"{episode.id}/{uuid.uuid4().hex[:16]}"

    def _prompt(self, request: Request, episode: Episode) -> Prompt:
        body, earlier = request.body, episode.views()
        try:
            if request.kind == "chat":
                prompt = self.prompts.chat(body.messages, earlier, body.tools)
            elif isinstance(body.prompt, str):
                prompt = self.prompts.text(body.prompt, earlier)
            else:
                prompt = self.prompts.tokens(body.prompt, earlier)
        except ValueError as exc:  # no chat template; a template that refuses these messages
            raise ApiError(400, str(exc), "invalid_request", "messages") from None
        except Exception as exc:  # a template's own error (jinja raises its own types)
            raise ApiError(
                400, f"the chat template cannot render these messages: {exc}", "invalid_request", "messages"
            ) from None
        vocabulary = len(self.tokenizer)
        if any(not 0 <= t < vocabulary for t in prompt.new_tokens):
            raise ApiError(400, f"the prompt holds token ids outside the vocabulary of {vocabulary}", "invalid_prompt")
        return prompt

    def _max_tokens(self, asked: int | None, prompt: Prompt) -> int:
        """The call's max_tokens: the client's, within generation.max_new_tokens, the model's context and the row's
        budget (gateway.max_episode_tokens); 400 when nothing fits."""
        most = min(asked or self.config.generation.max_new_tokens, self.config.generation.max_new_tokens)
        left_in_row = self.gateway.max_episode_tokens - (len(prompt.tokens) - prompt.row_start)
        left_in_context = self.context - len(prompt.tokens)
        if left_in_row < 1 or left_in_context < 1:
            which = (
                f"the episode's row holds {len(prompt.tokens) - prompt.row_start} of its "
                f"{self.gateway.max_episode_tokens} tokens (gateway.max_episode_tokens)"
                if left_in_row < 1
                else f"the prompt of {len(prompt.tokens)} tokens fills the model's context of {self.context}"
            )
            raise ApiError(400, f"no room for an answer: {which}", "context_length_exceeded", "messages")
        return min(most, left_in_row, left_in_context)

    # ------------------------------------------------------------------ the generators' answers

    def _read_answers(self) -> None:
        for completion in self.sampling.receive():
            if completion.reply_to != self.reply_to:
                continue  # another replica's (or a predecessor's)
            pending = self.pending.get(completion.call)
            if pending is None or pending.completion is not None:
                continue  # answered already (a generator answered a re-delivered request twice)
            pending.completion = completion
            self._deliver(pending)

    def _deliver(self, pending: _Pending) -> None:
        """Answer the call's clients, once the generators' answer is in and someone waits for it: write it to the
        log, then answer."""
        completion = pending.completion
        if completion is None or not pending.waiting:
            return
        del self.pending[pending.call]
        if completion.status != "ok":
            error = ApiError(400, f"the generator could not sample this call: {completion.status}", "cannot_sample")
            for request in pending.waiting:
                request.answer(error)
            return
        episode = self.book.get(pending.episode)
        if episode is None or episode.over:  # it ended while the call was sampled: nothing of it is trained
            self.counts["late_calls"] += 1
            for request in pending.waiting:
                request.answer(ApiError(409, f"episode {pending.episode} ended while the call was sampled", "ended"))
            return
        event = self._event(
            episode,
            "call",
            pending.call,
            version=completion.policy_version,
            lineage={k: v for k, v in completion.lineage.items() if k.startswith("generator.")},
            parent=pending.prompt.parent,
            request_digest=pending.request_digest,
            messages=pending.messages,
            prompt_text=pending.prompt.text,
            prompt_tokens=np.asarray(pending.prompt.new_tokens, np.int64),
            response_tokens=completion.response_tokens,
            behaviour_logprobs=completion.behaviour_logprobs,
            token_versions=completion.token_versions,
            text=completion.text,
            finish_reason=completion.finish_reason,
        )
        try:
            self._write(event)
        except Exception:
            for request in pending.waiting:
                request.answer(ApiError(503, "the log is unavailable: the call was not recorded; try again", "log"))
            raise
        self.counts["calls"] += 1
        answer = self._answer(event)
        for request in pending.waiting:
            request.answer(answer)

    def _answer(self, event: EpisodeEvent) -> Answer:
        episode = self.book.get(event.episode)
        call = episode.calls.get(event.event) if episode is not None else None
        prompt_tokens = len(call.view.prompt_tokens) if call is not None else len(event.prompt_tokens)
        return Answer(
            call=event.event,
            model=self.model_name,
            text=event.text,
            finish_reason=event.finish_reason,
            prompt_tokens=prompt_tokens,
            tokens=[self.tokenizer.decode([int(t)]) for t in event.response_tokens],
            logprobs=[float(v) for v in event.behaviour_logprobs],
            created=now(),
        )

    # ------------------------------------------------------------------ agents take episodes, reward and end them

    def _claim(self, request: Request) -> None:
        # A claim retried with its idempotency key (its answer was lost: the gateway died between writing the start
        # and answering) gets the episode it took, not a second one: the first would wait for an agent that never
        # comes until gateway.episode_timeout_s, and its group train a row short.
        claim = f"claim:{_key_hash(request.idempotency_key)}" if request.idempotency_key else ""
        if claim:
            taken = self._claimed(claim)
            if taken is None and self._read_on_for(request):  # another replica may have handed it out
                taken = self._claimed(claim)
            if taken is not None:
                self.counts["claims_retried"] += 1
                request.answer(self._task(taken))
                return
        if not self.offers:
            self.claims.append(request)
            return
        episode = self.book.get(self.offers.popleft())
        self._take(episode, request.body.agent, claim)
        request.answer(self._task(episode))

    def _claimed(self, claim: str) -> Episode | None:
        return next((e for e in self.book.episodes.values() if e.claim == claim and not e.over), None)

    def _take(self, episode: Episode, agent: str, claim: str = "") -> None:
        if episode.id in self.offers:
            self.offers.remove(episode.id)
        origin = self._origin(episode)
        prompt = origin.prompt_text[episode.row] if isinstance(origin, PromptBatch) else ""
        self._write(
            self._event(episode, "start", f"{episode.id}/start", detail=agent, request_digest=claim, prompt_text=prompt)
        )
        self.counts["episodes_taken"] += 1
        if not self.offers:
            self.offered_since = None

    def _task(self, episode: Episode) -> dict:
        key = episode_key(episode.id, self.secret)
        held = self.batches.get(episode.batch_id)
        # A retried claim served by a replica that does not hold the prompt batch: the prompt its start recorded.
        prompt, label = (
            (held.message.prompt_text[episode.row], held.message.prompt_label[episode.row])
            if held is not None
            else (episode.prompt, "")
        )
        return {
            "episode": episode.id,
            "key": key,
            "base_url": f"{self.url}/episodes/{key}/v1",
            "api_key": key,
            "model": self.model_name,
            "prompt": prompt,
            "label": label,
            "step": episode.step,
            "row": episode.row,
            "index": episode.index,
            "gateway": self.url,
        }

    def _reward(self, request: Request) -> None:
        episode = self._episode(request)
        try:
            total = request.body.total()
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_reward") from None
        if abs(episode.reward + total) > MAX_REWARD:
            raise ApiError(
                400, f"episode {episode.id}'s rewards would sum past ±{MAX_REWARD:g} ({episode.reward:g} so far)",
                "invalid_reward", "reward",
            )  # fmt: skip
        # A post with an idempotency key is one reward however often it comes: its retry after a gateway died between
        # writing the reward and the end (the client saw no answer) adds nothing.
        key = request.idempotency_key
        event_id = f"{episode.id}/reward/" + (_key_hash(key) if key else uuid.uuid4().hex[:12])
        if key and event_id not in self.book.seen:
            self._read_on_for(request)  # another replica may have written it
        if event_id not in self.book.seen:
            self._write(self._event(episode, "reward", event_id, reward=total))
        if request.body.done:
            self._finish(episode, "rewarded", "")
        request.answer({"episode": episode.id, "reward": episode.reward, "ended": request.body.done})

    def _end(self, request: Request) -> None:
        episode = self._episode(request)
        outcome = "rewarded" if episode.rewards else request.body.outcome
        self._finish(episode, outcome, request.body.detail)
        request.answer({"episode": episode.id, "reward": episode.reward, "ended": True, "outcome": outcome})

    def _finish(self, episode: Episode, outcome: str, detail: str) -> None:
        reward = episode.reward if outcome == "rewarded" else 0.0
        self._write(self._event(episode, "end", f"{episode.id}/end", reward=reward, outcome=outcome, detail=detail))

    # ------------------------------------------------------------------ offers, time, groups

    def _offer(self) -> None:
        """Offer the episodes of the groups the bound allows, and hand them to the agents that wait."""
        n = self.config.generation.n
        for batch in self.batches.values():
            while batch.unoffered and self.admission.admits(batch.message.step, batch.unoffered[0]):
                row = batch.unoffered.popleft()
                for index in range(n):
                    episode = self.book.open(episode_id(batch.message.step, row, index), batch.message.batch_id)
                    if not episode.started and not episode.over:  # one a predecessor had handed out goes on
                        self.offers.append(episode.id)
                        self.offered_since = self.offered_since or time.monotonic()
        while self.claims and self.offers:
            self._claim(self.claims.pop(0))
        now_ = time.monotonic()
        for request in [r for r in self.claims if now_ - r.received >= r.body.wait_s]:
            self.claims.remove(request)
            request.answer(None)  # 204: none came
        if self.offered_since and now_ - self.offered_since > IDLE_SAY_S and now_ - self.said_idle > IDLE_SAY_S:
            self.said_idle = now_
            log.warning(
                "%s: %d episodes have waited %.0f s for an agent: nothing took one (POST %s/episodes/claim%s)",
                self.replica_id,
                len(self.offers),
                now_ - self.offered_since,
                self.url,
                "" if self.gateway.agent is None else f"; gateway.agent runs {self.gateway.agent.placement}",
            )

    def _expire(self) -> None:
        now_ = time.monotonic()
        limit = self.gateway.call_timeout_s
        for pending in list(self.pending.values()):
            late = [request for request in pending.waiting if now_ - request.received >= limit]
            for request in late:  # told to try again; the call goes on, and the retry waits for its answer
                pending.waiting.remove(request)
                self.counts["calls_timed_out"] += 1
                request.answer(ApiError(503, f"no answer from the generators within {limit:.0f} s; try again", "busy"))
            episode = self.book.get(pending.episode)
            if not pending.waiting and (episode is None or episode.over):  # nobody will ask for it again
                del self.pending[pending.call]
                self.counts["answers_unclaimed"] += 1
        busy = {p.episode for p in self.pending.values() if p.waiting}
        limit = self.gateway.episode_timeout_s
        for batch in self.batches.values():
            for row in batch.open_rows:
                for index in range(self.config.generation.n):
                    episode = self.book.get(episode_id(batch.message.step, row, index))
                    if episode and episode.started and not episode.over and episode.id not in busy:
                        if now_ - episode.active >= limit:
                            # Rewards posted (with done: false) are the episode's outcome: its end just never came.
                            outcome = "rewarded" if episode.rewards else "timed_out"
                            self._finish(episode, outcome, f"no call, reward or end for {limit:.0f} s")

    def _settle(self) -> list[Collected]:
        """The groups whose episodes have all ended (as the log has it), as rollouts records."""
        out = []
        n = self.config.generation.n
        for batch_id, batch in list(self.batches.items()):
            for row in sorted(batch.open_rows):
                episodes = [self.book.get(episode_id(batch.message.step, row, i)) for i in range(n)]
                if not all(episode is not None and episode.end is not None for episode in episodes):
                    continue
                batch.open_rows.remove(row)
                out.append(Collected(batch_id, [self._group(batch.message, row, episodes)], not batch.open_rows))
                for episode in episodes:
                    self.book.forget(episode.id)
            if not batch.open_rows:
                del self.batches[batch_id]
        return out

    def _group(self, message: PromptBatch, row: int, episodes: list[Episode]) -> RolloutBatch:
        """The group's record: each episode's rows with its reward, as the outcome and gateway.unrewarded say."""
        kept: list[tuple[Row, float]] = []
        for episode in episodes:
            outcome, rows = episode.end.outcome, episode.rows()
            self.counts[f"episodes_{outcome}"] += 1
            self.counts["rows_split"] += max(0, len(rows) - 1)
            if not rows:
                self.counts["episodes_without_calls"] += 1
                continue
            if outcome == "rewarded":
                reward = episode.reward
            elif self.gateway.unrewarded == "dead_letter":
                detail = episode.end.detail or "no detail"
                why = f"episode {episode.id} {outcome.replace('_', ' ')} without a reward ({detail})"
                self.log.dead_letter(self._record(message, row, [(r, 0.0) for r in rows]), why)
                self.counts["episodes_dead_lettered"] += 1
                continue
            else:
                reward = self.gateway.unrewarded_reward if self.gateway.unrewarded == "reward" else 0.0
            kept += [(r, reward) for r in rows]
        if not kept:  # the record still goes, empty, so that the learner counts the group as used up
            log.warning(
                "%s: group %d/%d has no episode to train on: it is dead-lettered whole",
                self.replica_id,
                message.step,
                row,
            )
            self.counts["groups_dead_lettered"] += 1
        return self._record(message, row, kept, dead=not kept)

    def _record(
        self, message: PromptBatch, row: int, rows: list[tuple[Row, float]], dead: bool = False
    ) -> RolloutBatch:
        """The record of a group's ``rows`` (each with its reward), or of none: a group ``dead``-lettered whole."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        prompt_width = max((len(r.prompt_tokens) for r, _ in rows), default=1)
        width = max((len(r.response_tokens) for r, _ in rows), default=1)

        def padded(arrays, size, value, dtype):
            out = np.full((len(arrays), size), value, dtype=dtype)
            for i, array in enumerate(arrays):
                out[i, : len(array)] = array
            return out

        mask = padded([r.model_mask for r, _ in rows], width, False, bool)
        versions = padded([r.versions for r, _ in rows], width, 0, np.int32)
        oldest = int(versions[mask].min()) if mask.any() else self.policy_version
        gen = self.config.generation
        lineage = {
            **message.lineage,
            "sampling.temperature": gen.temperature,
            "sampling.top_p": gen.top_p,
            "sampling.top_k": gen.top_k,
            "gateway.replica": self.replica_id,
            "actor.model": self.model_id,
        }
        responses = padded([r.response_tokens for r, _ in rows], width, pad, np.int64)
        lengths = np.array([len(r.response_tokens) for r, _ in rows], np.int64)
        return RolloutBatch(
            **new_header(f"{message.batch_id}/{row}-{row}", self.replica_id, oldest, lineage),
            step=message.step,
            group_index=np.full(len(rows), row, np.int64),
            prompt_text=[message.prompt_text[row]] * len(rows),
            prompt_label=[message.prompt_label[row]] * len(rows),
            response_text=[self.tokenizer.decode(t[:n], skip_special_tokens=True) for t, n in zip(responses, lengths)],
            prompt_tokens=padded([r.prompt_tokens for r, _ in rows], prompt_width, pad, np.int64),
            prompt_lengths=np.array([len(r.prompt_tokens) for r, _ in rows], np.int64),
            response_tokens=responses,
            response_lengths=lengths,
            finished=np.array([r.finish_reason == "stop" for r, _ in rows]),
            behaviour_logprobs=padded([r.logprobs for r, _ in rows], width, 0.0, np.float32),
            token_versions=versions,
            response_mask=mask,
            turns=np.array([r.calls for r, _ in rows], np.int64),
            environment_reward=np.array([reward for _, reward in rows], np.float32),
            dead_lettered_groups=np.array([row] if dead else [], np.int64),
        )

    def _forget_used_up(self) -> None:
        """Drop the episodes of groups the learner has used up (another replica's: this one holds its own until it
        sends them), keeping the book's memory bounded over a long run."""
        used = self.admission.groups_done - (self.admission.max_staleness + 1) * self.admission.per_update
        held = {batch_id for batch_id in self.batches}
        for episode in list(self.book.episodes.values()):
            if episode.batch_id not in held and self.admission.groups_before(episode.step) + episode.row < used:
                self.book.forget(episode.id)

    # ------------------------------------------------------------------ what it says about itself

    def _waiting(self) -> list[Request]:
        return [*self.claims, *(r for p in self.pending.values() for r in p.waiting)]

    def _health(self) -> dict:
        return {
            "status": "ok",
            "replica": self.replica_id,
            "model": self.model_name,
            "policy_version": self.policy_version,
            "episodes_offered": len(self.offers),
            "calls_in_flight": len(self.pending),
            "chat_template": self.template_problem or "append-only",
            "counts": dict(self.counts),
        }

    def counters(self) -> dict[str, int]:
        return dict(self.counts)


@dataclass
class _Origin:
    """The lineage of an episode whose prompt batch this replica does not hold."""

    lineage: dict


def _key_hash(idempotency_key: str) -> str:
    """A client's idempotency key as part of an event id: short, and the same on every replica."""
    return hashlib.blake2b(idempotency_key.encode(), digest_size=8).hexdigest()


def _digest(body) -> str:
    """The request as the client sent it, less how it is to be delivered: equal for a retry of the same call."""
    fields = body.model_dump(exclude={"stream", "stream_options"})
    return (
        "blake2b:"
        + hashlib.blake2b(json.dumps(fields, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()
    )


def _context_length(path, config: RunConfig) -> int:
    """The longest prompt and answer the generators can sample: the engine's max_model_len, else the model's own."""
    if config.generation.vllm.max_model_len is not None:
        return config.generation.vllm.max_model_len
    model = AutoConfig.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)
    return int(getattr(model, "max_position_embeddings", None) or 4096)
