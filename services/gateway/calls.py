"""Agents' calls to the model (:class:`CallsInFlight`): each one's prompt within its limits, the calls at the
generators and the clients that wait for each, and the answer made from a call's event on the log.

A call sent to the generators keeps its clients waiting for the answer; one that waits past
``gateway.call_timeout_s`` is told to try again, and the call goes on: a retry waits for the same answer (never a
second sample), which is written to the log once someone waits for it (an answer nobody asks for again is never
trained).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from common.config import RunConfig
from common.schema import ADMITTED_EPOCH, Completion, CompletionRequest, EpisodeEvent, new_header
from services.gateway.api import Answer, ApiError, now
from services.gateway.conversation import Prompt, Prompts
from services.gateway.episodes import Episode, EpisodeBook
from services.gateway.http import Request
from services.gateway.log import EpisodesLog
from services.service import Channel

__all__ = [
    "Calls",
    "CallsInFlight",
    "PendingCall",
    "answer_of",
    "call_digest",
    "call_max_tokens",
    "call_prompt",
    "key_hash",
]


@dataclass
class PendingCall:
    """A call at the generators (see the module's docstring)."""

    episode: str
    call: str
    prompt: Prompt
    request_digest: str
    messages: int  # the chat's messages (0: a prompt of the completions API)
    waiting: list[Request] = field(default_factory=list)
    completion: Completion | None = None  # the generators' answer, while nobody waits for it


class CallsInFlight:
    """The calls this replica sent to the generators and has not answered, by call id."""

    def __init__(self):
        self.pending: dict[str, PendingCall] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def __contains__(self, call: str) -> bool:
        return call in self.pending

    def __getitem__(self, call: str) -> PendingCall:
        return self.pending[call]

    def add(self, call: PendingCall) -> None:
        self.pending[call.call] = call

    def remove(self, call: str) -> None:
        del self.pending[call]

    def of(self, episode: str) -> list[PendingCall]:
        return [p for p in self.pending.values() if p.episode == episode]

    def answered(self, completion: Completion, reply_to: str) -> PendingCall | None:
        """The call a generator's answer is for, now holding it; None for another replica's (or a predecessor's),
        or a call answered already (a generator answered a re-delivered request twice)."""
        if completion.reply_to != reply_to:
            return None
        pending = self.pending.get(completion.call)
        if pending is None or pending.completion is not None:
            return None
        pending.completion = completion
        return pending

    def expire(self, limit_s: float, book: EpisodeBook) -> tuple[int, int]:
        """Tell the clients that waited ``limit_s`` to try again (the call goes on), and forget the answers nobody
        will ask for again (their episode over); how many of each."""
        timed_out = unclaimed = 0
        now_ = time.monotonic()
        for pending in list(self.pending.values()):
            late = [request for request in pending.waiting if now_ - request.received >= limit_s]
            for request in late:
                pending.waiting.remove(request)
                timed_out += 1
                request.answer(
                    ApiError(503, f"no answer from the generators within {limit_s:.0f} s; try again", "busy")
                )
            episode = book.get(pending.episode)
            if not pending.waiting and (episode is None or episode.over):
                del self.pending[pending.call]
                unclaimed += 1
        return timed_out, unclaimed

    def busy_episodes(self) -> set[str]:
        """The episodes with a client waiting for a call's answer (not idle, whatever their last event's time)."""
        return {p.episode for p in self.pending.values() if p.waiting}

    def waiting(self) -> list[Request]:
        return [r for p in self.pending.values() for r in p.waiting]


class Calls:
    """An episode's calls, from the request to the answer: its id (a retry's is its first's), its prompt within its
    limits, the request to the generators, their answer written to the log, then given to every client that waits."""

    def __init__(
        self,
        config: RunConfig,
        tokenizer,
        model_name: str,
        context: int,
        log: EpisodesLog,
        lineage_of: Callable[[Episode], dict],
        admitted_by: Callable[[], tuple[int, int]],
        counts: Counter[str],
        producer: str,
    ):
        self.config, self.tokenizer, self.model_name, self.context = config, tokenizer, model_name, context
        self.log, self.lineage_of, self.counts, self.producer = log, lineage_of, counts, producer
        self.admitted_by = admitted_by  # (learner epoch, version) of the announcement the gateway admits by
        self.prompts = Prompts(tokenizer)
        self.in_flight = CallsInFlight()
        self.reply_to = f"{producer}/{uuid.uuid4().hex[:12]}"  # the answers this process waits for
        self.sampling: Channel | None = None

    def call(self, request: Request, episode: Episode) -> None:
        """Answer ``request`` (a call of ``episode``): again if answered before, once its answer comes if at the
        generators, else sent to them; 400 past gateway.max_calls, a prompt that cannot be, or no room to answer."""
        body, gateway = request.body, self.config.gateway
        digest = call_digest(body)
        call_id = self._call_id(episode, request, digest)
        if call_id in episode.calls:  # a retry of a call answered before: the same answer
            self.counts["retries_answered"] += 1
            request.answer(answer_of(episode.calls[call_id].event, self.log.book, self.tokenizer, self.model_name))
            return
        if call_id in self.in_flight:
            self.in_flight[call_id].waiting.append(request)
            self.deliver(self.in_flight[call_id])
            return
        # Calls at the generators count too: 200 parallel calls to one episode all came before any was answered.
        if len(episode.calls) + len(self.in_flight.of(episode.id)) >= gateway.max_calls:
            raise ApiError(400, f"episode {episode.id} has had its {gateway.max_calls} calls (gateway.max_calls)",
                           "max_calls")  # fmt: skip
        prompt = call_prompt(self.prompts, len(self.tokenizer), request, episode)
        if not prompt.parent and episode.calls and self.log.read_on_for(request):
            self.call(request, episode)  # it may extend a call another replica answered, not read here before
            return
        max_tokens = call_max_tokens(self.config, self.context, body.limit, prompt)
        if not prompt.parent and episode.calls:
            self.counts["splits"] += 1  # a new row of the episode (see episodes.py)
        gen = self.config.generation
        epoch, version = self.admitted_by()
        self.sampling.send(
            CompletionRequest(
                **new_header(call_id, self.producer, version, {**self.lineage_of(episode), ADMITTED_EPOCH: epoch}),
                step=episode.step,
                episode=episode.id,
                call=call_id,
                reply_to=self.reply_to,
                prompt_tokens=np.asarray(prompt.tokens, np.int64),
                max_tokens=max_tokens,
                temperature=gen.temperature,
                top_p=gen.top_p,
                top_k=gen.top_k,
                # Unseeded unless the client asks: a call is sampled once (a retry gets its answer), and seeded
                # requests crashed vLLM for CPUs 0.32 under 128 concurrent calls (it rewinds a request's generator
                # after a split prefill, which a CPU generator cannot: benchmarks/RESULTS.md, section 15).
                seed=body.seed if body.seed is not None and body.seed >= 0 else -1,
                stop=body.stops,
            )
        )
        messages = len(body.messages) if request.kind == "chat" else 0
        self.in_flight.add(PendingCall(episode.id, call_id, prompt, digest, messages, [request]))
        episode.active = time.monotonic()

    def _call_id(self, episode: Episode, request: Request, digest: str) -> str:
        """The call's id: the client's idempotency key's, or for a client's retry (x-stainless-retry-count) of a call
        answered before, that call's (same request, the newest); else a new one."""
        if request.idempotency_key:
            call_id = f"{episode.id}/k{key_hash(request.idempotency_key)}"
            if call_id not in episode.calls and call_id not in self.in_flight:
                self.log.read_on_for(request)  # another replica may have answered it
            return call_id
        if request.retries:
            self.log.read_on_for(request)  # another replica may have answered it
            same = [call for call in episode.calls.values() if call.event.request_digest == digest]
            waiting = [p.call for p in self.in_flight.of(episode.id) if p.request_digest == digest]
            if waiting or same:
                return (waiting or [same[-1].id])[-1]
        return f"{episode.id}/{uuid.uuid4().hex[:16]}"

    def read_answers(self) -> None:
        """Deliver the generators' answers to this process's calls."""
        for completion in self.sampling.receive():
            pending = self.in_flight.answered(completion, self.reply_to)
            if pending is not None:
                self.deliver(pending)

    def deliver(self, pending: PendingCall) -> None:
        """Answer the call's clients, once the generators' answer is in and someone waits for it: write it to the
        log, then answer."""
        completion = pending.completion
        if completion is None or not pending.waiting:
            return
        self.in_flight.remove(pending.call)
        if completion.status != "ok":
            error = ApiError(400, f"the generator could not sample this call: {completion.status}", "cannot_sample")
            for request in pending.waiting:
                request.answer(error)
            return
        episode = self.log.book.get(pending.episode)
        if episode is None or episode.over:  # it ended while the call was sampled: nothing of it is trained
            self.counts["late_calls"] += 1
            for request in pending.waiting:
                request.answer(ApiError(409, f"episode {pending.episode} ended while the call was sampled", "ended"))
            return
        event = self.log.event(
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
            self.log.write(event)
        except Exception:
            for request in pending.waiting:
                request.answer(ApiError(503, "the log is unavailable: the call was not recorded; try again", "log"))
            raise
        self.counts["calls"] += 1
        answer = answer_of(event, self.log.book, self.tokenizer, self.model_name)
        for request in pending.waiting:
            request.answer(answer)

    def expire(self) -> None:
        """Clients that waited past gateway.call_timeout_s told to try again (the call goes on); answers nobody will
        ask for again forgotten."""
        timed_out, unclaimed = self.in_flight.expire(self.config.gateway.call_timeout_s, self.log.book)
        self.counts["calls_timed_out"] += timed_out
        self.counts["answers_unclaimed"] += unclaimed


def key_hash(idempotency_key: str) -> str:
    """A client's idempotency key as part of an event id: short, and the same on every replica."""
    return hashlib.blake2b(idempotency_key.encode(), digest_size=8).hexdigest()


def call_digest(body) -> str:
    """The request as the client sent it, less how it is to be delivered: equal for a retry of the same call."""
    fields = body.model_dump(exclude={"stream", "stream_options"})
    return (
        "blake2b:"
        + hashlib.blake2b(json.dumps(fields, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()
    )


def call_prompt(prompts: Prompts, vocabulary: int, request: Request, episode: Episode) -> Prompt:
    """The call's prompt, reusing the episode's earlier tokens where it extends an earlier call (:mod:`.conversation`);
    400 for messages the chat template refuses and token ids outside the vocabulary."""
    body, earlier = request.body, episode.views()
    try:
        if request.kind == "chat":
            prompt = prompts.chat(body.messages, earlier, body.tools)
        elif isinstance(body.prompt, str):
            prompt = prompts.text(body.prompt, earlier)
        else:
            prompt = prompts.tokens(body.prompt, earlier)
    except ValueError as exc:  # no chat template; a template that refuses these messages
        raise ApiError(400, str(exc), "invalid_request", "messages") from None
    except Exception as exc:  # a template's own error (jinja raises its own types)
        raise ApiError(
            400, f"the chat template cannot render these messages: {exc}", "invalid_request", "messages"
        ) from None
    if any(not 0 <= t < vocabulary for t in prompt.new_tokens):
        raise ApiError(400, f"the prompt holds token ids outside the vocabulary of {vocabulary}", "invalid_prompt")
    return prompt


def call_max_tokens(config: RunConfig, context: int, asked: int | None, prompt: Prompt) -> int:
    """The call's max_tokens: the client's, within generation.max_new_tokens, the model's context and the row's
    budget (gateway.max_episode_tokens); 400 when nothing fits."""
    most = min(asked or config.generation.max_new_tokens, config.generation.max_new_tokens)
    budget = config.gateway.max_episode_tokens
    left_in_row = budget - (len(prompt.tokens) - prompt.row_start)
    left_in_context = context - len(prompt.tokens)
    if left_in_row < 1 or left_in_context < 1:
        which = (
            f"the episode's row holds {len(prompt.tokens) - prompt.row_start} of its {budget} tokens "
            "(gateway.max_episode_tokens)"
            if left_in_row < 1
            else f"the prompt of {len(prompt.tokens)} tokens fills the model's context of {context}"
        )
        raise ApiError(400, f"no room for an answer: {which}", "context_length_exceeded", "messages")
    return min(most, left_in_row, left_in_context)


def answer_of(event: EpisodeEvent, book: EpisodeBook, tokenizer, model: str) -> Answer:
    """What a call's clients get, made from its event on the log (a retry's the same)."""
    episode = book.get(event.episode)
    call = episode.calls.get(event.event) if episode is not None else None
    prompt_tokens = len(call.view.prompt_tokens) if call is not None else len(event.prompt_tokens)
    return Answer(
        call=event.event,
        model=model,
        text=event.text,
        finish_reason=event.finish_reason,
        prompt_tokens=prompt_tokens,
        tokens=[tokenizer.decode([int(t)]) for t in event.response_tokens],
        logprobs=[float(v) for v in event.behaviour_logprobs],
        created=now(),
    )
