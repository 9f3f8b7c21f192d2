"""Agents that run a gateway's episodes: your function, called with each episode, in worker threads.

The function is yours and talks to the model through any OpenAI client pointed at the episode's base URL::

    from openai import OpenAI

    def solve(episode):
        client = OpenAI(base_url=episode.base_url, api_key=episode.api_key)
        messages = [{"role": "user", "content": episode.prompt}]
        answer = client.chat.completions.create(model=episode.model, messages=messages)
        return 1.0 if answer.choices[0].message.content.strip() == episode.label else 0.0

A number it returns is the episode's reward (posted, and the episode ended); None ends the episode without one (the
run's reward section, or ``gateway.unrewarded``, decides); it may post rewards itself (``episode.reward(...)``). An
exception ends the episode as failed, with the error. Where the workers run is ``gateway.agent.placement``: threads
of each gateway replica (local), or ``streamppo agents`` anywhere that reaches a gateway (remote).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from common.named import load_named

log = logging.getLogger(__name__)

__all__ = ["AgentPool", "Episode"]

CLAIM_WAIT_S = 5.0  # how long one claim waits at the gateway for an episode
AWAY_BACKOFF_S = (0.5, 8.0)  # a gateway that does not answer: retried after this, doubling
SAME_GATEWAY_TRIES = 5  # a claim that got no answer is retried at the same gateway this often, then at the next


@dataclass(frozen=True)
class Episode:
    """One episode, as an agent gets it."""

    id: str
    base_url: str  # the OpenAI API of this episode: .../episodes/<key>/v1
    api_key: str  # the episode's key (for clients that want one; the base URL carries it too)
    model: str  # the model's name to ask for
    prompt: str  # the dataset row's prompt
    label: str  # the dataset row's label ('' where it has none)
    gateway: str  # the gateway that handed it out

    def reward(self, value: float, done: bool = True, idempotency_key: str | None = None) -> None:
        """Post a reward (one outcome; several posts add up); ``done``: the episode is over. Posts with the same
        ``idempotency_key`` count once (give one to post again after an error)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        _post(f"{self.gateway}/episodes/{self.api_key}/reward", {"reward": value, "done": done}, headers)

    def end(self, outcome: str = "ended", detail: str = "") -> None:
        """End the episode without a reward (``outcome`` ended, or failed with ``detail``)."""
        _post(f"{self.gateway}/episodes/{self.api_key}/end", {"outcome": outcome, "detail": detail[:2000]})


class Refused(RuntimeError):
    """The gateway answered with an error (its status and message)."""

    def __init__(self, url: str, status: int, text: str):
        super().__init__(f"POST {url}: {status} {text[:500]}")
        self.status = status


def _post(url: str, body: dict, headers: dict | None = None) -> dict:
    response = httpx.post(url, json=body, headers=headers, timeout=60)
    if response.status_code >= 400:
        raise Refused(url, response.status_code, response.text)
    return response.json() if response.content else {}


class AgentPool:
    """``workers`` threads, each taking an episode from the gateways (in turn) and running ``function`` on it."""

    def __init__(
        self, function: str | Callable[[Episode], float | None], gateways: list[str], workers: int, name: str = "agents"
    ):
        self.function = load_named(function, "gateway.agent.function") if isinstance(function, str) else function
        self.gateways, self.name = [g.rstrip("/") for g in gateways], name
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._work, args=(i,), name=f"agent-{i}", daemon=True) for i in range(workers)
        ]
        self.done = 0  # episodes run (for the caller's report)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stopping.set()
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def run(self) -> None:
        """Work until stopped (Ctrl-C), in this thread's stead."""
        self.start()
        try:
            while not self.stopping.is_set():
                time.sleep(0.5)
        finally:
            self.stop()

    def _work(self, number: int) -> None:
        backoff = AWAY_BACKOFF_S[0]
        turn = number
        claim = None  # a claim's idempotency key, the same until it is answered: a retry gets the episode it took
        failures = 0  # of this claim at this gateway
        with httpx.Client(timeout=CLAIM_WAIT_S + 30) as client:
            while not self.stopping.is_set():
                if failures >= SAME_GATEWAY_TRIES:
                    turn, failures = turn + 1, 0
                gateway = self.gateways[turn % len(self.gateways)]
                claim = claim or uuid.uuid4().hex
                try:
                    response = client.post(
                        f"{gateway}/episodes/claim",
                        json={"agent": f"{self.name}/{number}", "wait_s": CLAIM_WAIT_S},
                        headers={"Idempotency-Key": claim},
                    )
                except httpx.HTTPError as exc:
                    # The same gateway again first (a replica started again under its name reads what it wrote
                    # before): the claim may have taken an episode there.
                    failures += 1
                    log.info("agents: gateway %s does not answer (%s); again in %.1f s", gateway, exc, backoff)
                    self.stopping.wait(backoff)
                    backoff = min(backoff * 2, AWAY_BACKOFF_S[1])
                    continue
                backoff, failures = AWAY_BACKOFF_S[0], 0
                turn += 1
                if response.status_code != 503:
                    claim = None  # answered: the next claim is another
                if response.status_code == 204 or self.stopping.is_set():
                    continue
                if response.status_code != 200:
                    log.warning("agents: claim at %s: %d %s", gateway, response.status_code, response.text[:300])
                    self.stopping.wait(backoff)
                    continue
                task = response.json()
                self._run(
                    Episode(
                        task["episode"],
                        task["base_url"],
                        task["api_key"],
                        task["model"],
                        task["prompt"],
                        task["label"],
                        task["gateway"],
                    )
                )

    def _run(self, episode: Episode) -> None:
        try:
            reward = self.function(episode)
        except Exception as exc:
            log.warning("agents: episode %s failed: %s: %s", episode.id, type(exc).__name__, exc)
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            self._close(episode, lambda: episode.end("failed", detail))
            return
        if reward is None:
            self._close(episode, episode.end)
        else:
            key = f"{episode.id}/returned"  # its retries below count once
            self._close(episode, lambda: episode.reward(float(reward), idempotency_key=key))
        self.done += 1

    def _close(self, episode: Episode, close: Callable[[], None]) -> None:
        """Post the episode's end, again while the gateway does not answer (another replica may take it over); an
        episode that ended meanwhile (a timeout, or the agent posted its reward with done) is left as it is."""
        backoff = AWAY_BACKOFF_S[0]
        while not self.stopping.is_set():
            try:
                close()
                return
            except Refused as exc:
                if exc.status != 409:  # 409: it ended meanwhile
                    log.warning("agents: ending episode %s: %s", episode.id, exc)
                return
            except httpx.HTTPError as exc:
                log.info("agents: ending episode %s: %s; again in %.1f s", episode.id, exc, backoff)
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, AWAY_BACKOFF_S[1])
