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
rollouts record once all of its episodes have ended (:mod:`.groups`: one row per chain of calls); an episode that
ended without a reward is trained, scored or dead-lettered as ``gateway.unrewarded`` says, and counted. Any replica
serves any episode: each reads the whole log (the episodes it learns of from others' events), and reads it to its end
before it decides that a call extends nothing, that a retried call is new, or that an episode does not exist, where
another replica may have written what it has not read yet.

Its parts: the episodes log (:mod:`.log`), the offers (:mod:`.offers`), the calls (:mod:`.calls`), the groups'
records (:mod:`.groups`); this module is the service, which dispatches requests to them.

Weights are never waited for: the generators load new ones while calls are sampled, every token labelled with the
version that sampled it, and no call is refused or held for an update.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from collections import Counter

from transformers import AutoConfig

from common.admission import Admission
from common.config import RunConfig
from common.models import load_tokenizer, resolve_model
from common.schema import LEARNER_GROUPS_DONE, PromptBatch, WeightAnnouncement
from services.gateway.api import MAX_REWARD, ApiError
from services.gateway.calls import Calls, key_hash
from services.gateway.conversation import append_only_violation
from services.gateway.episodes import Episode, EpisodeKeyError, episode_of_key
from services.gateway.groups import GroupRecords
from services.gateway.http import GatewayServer, Request
from services.gateway.log import EpisodesLog
from services.gateway.offers import Offers
from services.service import Channel, Collected, Service

log = logging.getLogger(__name__)

__all__ = ["GatewayService"]

WAIT_S = 0.005  # how long one collect() waits for a request: what an answer may wait to be read, at most


class GatewayService(Service):
    role = "gateway"

    @classmethod
    def check_inputs(cls, config: RunConfig) -> None:
        resolve_model(config.model.actor, config.model.cache_dir)  # its tokenizer and chat template

    def __init__(self, config: RunConfig, replica_id: str | None = None):
        super().__init__(config, replica_id)
        self.gateway = config.gateway
        path = resolve_model(config.model.actor, config.model.cache_dir)
        self.tokenizer = load_tokenizer(path, config.model.trust_remote_code)
        self.model_name = self.gateway.model_name or path.name
        self.template_problem = append_only_violation(self.tokenizer)
        if self.template_problem:
            log.warning("%s: %s", self.replica_id, self.template_problem)
        self.secret = config.signing_key()
        self.counts: Counter[str] = Counter()
        self.policy_version = 0
        self.epoch = 0  # of the learner whose announcement the gateway admits by
        self.admission = Admission(config)
        version = lambda: self.policy_version  # noqa: E731
        self.log = EpisodesLog(
            self.replica_id, self.tokenizer, self.counts, lambda e: self.offers.lineage_of(e), version
        )
        self.book = self.log.book
        self.offers = Offers(config, self.admission, self.book, self.run_id)
        context = _context_length(path, config)
        admitted_by = lambda: (self.epoch, self.policy_version)  # noqa: E731
        self.calls = Calls(config, self.tokenizer, self.model_name, context, self.log, self.offers.lineage_of,
                           admitted_by, self.counts, self.replica_id)  # fmt: skip
        self.groups = GroupRecords(config, self.tokenizer, self.replica_id, str(path), self.counts)
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.server: GatewayServer | None = None
        self.agents = None  # the run's own agents (gateway.agent, placement local)

    # ------------------------------------------------------------------ lifecycle

    def channels(self) -> dict[str, tuple[str, str]]:
        return {"sampling": ("requests", "completions"), "episodes": ("episodes", "episodes")}

    def connect(self, channels: dict[str, Channel]) -> None:
        self.calls.sampling, self.log.channel = channels["sampling"], channels["episodes"]

    def start(self) -> list:
        # Everything the log holds first (a replica that starts again knows every episode before it answers).
        self.log.catch_up()
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
        for request in [*self.offers.claims, *self.calls.in_flight.waiting()]:
            request.answer(stopping)
        while not self.inbox.empty():
            self.inbox.get_nowait().answer(stopping)
        if self.server is not None:
            self.server.stop()
        if self.agents is not None:
            self.agents.stop()

    def on_weights(self, announcement: WeightAnnouncement) -> bool:
        # Nothing to load: the learner's progress (for the bound), and the version its calls must be answered with.
        # The feed offers only what supersedes the last (a new learner epoch may go back to a lower version).
        self.policy_version = announcement.policy_version
        self.epoch = announcement.learner_epoch
        done = int(
            announcement.lineage.get(LEARNER_GROUPS_DONE, announcement.policy_version * self.admission.per_update)
        )
        self.admission.groups_done = done
        self.offers.forget_used_up()
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
        return self.offers.room()

    def admit(self, message: PromptBatch) -> None:
        self.offers.admit(message)

    def under_way(self) -> bool:
        return bool(self.offers.batches or self.calls.in_flight)

    def in_hand(self) -> str:
        return self.offers.in_hand(self.policy_version)

    def collect(self) -> list[Collected]:
        """One round of the loop: the log and the generators' answers read, requests served, episodes offered, what
        timed out ended, and the groups whose episodes have all ended sent."""
        self.log.read()
        self.calls.read_answers()
        self._serve(WAIT_S)  # a short wait for requests paces the loop: with calls at the generators it spun at a core
        self._offer()
        self._expire()
        return self._settle()

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
        except EpisodeKeyError as exc:
            raise ApiError(401, str(exc), "invalid_api_key") from None
        episode = self.book.get(name)
        unknown = episode is None or not episode.started
        if unknown and name not in self.book.gone and self.log.read_on_for(request):  # another replica handed it out?
            episode = self.book.get(name)
        if name in self.book.gone or (episode is not None and episode.over):
            raise ApiError(409, f"episode {name} has ended", "episode_ended")
        if episode is None or (not episode.started and episode.id not in self.offers):
            raise ApiError(404, f"episode {name} is not one this run has handed out", "episode_not_found")
        return episode

    def _call(self, request: Request) -> None:
        episode, body = self._episode(request), request.body
        if body.model != self.model_name:
            raise ApiError(
                404,
                f"the model {body.model!r} is not served here: the gateway serves {self.model_name!r}",
                "model_not_found",
                "model",
            )
        if not episode.started:  # its base URL used before a claim (an agent given it by other means): taken now
            self._take(self.offers.take(episode.id), "first call")
        self.calls.call(request, episode)

    # ------------------------------------------------------------------ agents take episodes, reward and end them

    def _claim(self, request: Request) -> None:
        # A claim retried with its idempotency key (its answer was lost: the gateway died between writing the start
        # and answering) gets the episode it took, not a second one: the first would wait for an agent that never
        # comes until gateway.episode_timeout_s, and its group train a row short.
        claim = f"claim:{key_hash(request.idempotency_key)}" if request.idempotency_key else ""
        if claim:
            taken = self.log.claimed(claim)
            if taken is None and self.log.read_on_for(request):  # another replica may have handed it out
                taken = self.log.claimed(claim)
            if taken is not None:
                self.counts["claims_retried"] += 1
                request.answer(self.offers.task(taken, self.secret, self.url, self.model_name))
                return
        if not self.offers:
            self.offers.claims.append(request)
            return
        episode = self._take(self.offers.take(), request.body.agent, claim)
        request.answer(self.offers.task(episode, self.secret, self.url, self.model_name))

    def _take(self, episode: Episode, agent: str, claim: str = "") -> Episode:
        return self.log.start(episode, agent, claim, self.offers.prompt_of(episode)[0])

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
        event_id = f"{episode.id}/reward/" + (key_hash(key) if key else uuid.uuid4().hex[:12])
        if key and event_id not in self.book.seen:
            self.log.read_on_for(request)  # another replica may have written it
        self.log.reward(episode, event_id, total)
        if request.body.done:
            self.log.finish(episode, "rewarded", "")
        request.answer({"episode": episode.id, "reward": episode.reward, "ended": request.body.done})

    def _end(self, request: Request) -> None:
        episode = self._episode(request)
        outcome = "rewarded" if episode.rewards else request.body.outcome
        self.log.finish(episode, outcome, request.body.detail)
        request.answer({"episode": episode.id, "reward": episode.reward, "ended": True, "outcome": outcome})

    # ------------------------------------------------------------------ offers, time, groups

    def _offer(self) -> None:
        """Offer the episodes of the groups the bound allows, and hand them to the agents that wait."""
        self.offers.offer()
        while self.offers.claims and self.offers:
            self._claim(self.offers.claims.pop(0))
        now_ = time.monotonic()
        for request in self.offers.waited_too_long(now_):
            request.answer(None)  # 204: none came
        idle = self.offers.idle_for(now_)
        if idle is not None:
            log.warning(
                "%s: %d episodes have waited %.0f s for an agent: nothing took one (POST %s/episodes/claim%s)",
                self.replica_id,
                len(self.offers),
                idle,
                self.url,
                "" if self.gateway.agent is None else f"; gateway.agent runs {self.gateway.agent.placement}",
            )

    def _expire(self) -> None:
        """Clients that waited past gateway.call_timeout_s told to try again (the call goes on); episodes with no
        call, reward or end for gateway.episode_timeout_s ended."""
        self.calls.expire()
        limit = self.gateway.episode_timeout_s
        for episode in self.offers.idle_episodes(self.calls.in_flight.busy_episodes(), limit):
            # Rewards posted (with done: false) are the episode's outcome: its end just never came.
            outcome = "rewarded" if episode.rewards else "timed_out"
            self.log.finish(episode, outcome, f"no call, reward or end for {limit:.0f} s")

    def _settle(self) -> list[Collected]:
        """The groups whose episodes have all ended (as the log has it), as rollouts records."""
        return self.groups.settle(self.offers.batches, self.book, self.policy_version, self.log.channel.dead_letter)

    # ------------------------------------------------------------------ what it says about itself

    def _health(self) -> dict:
        return {
            "status": "ok",
            "replica": self.replica_id,
            "model": self.model_name,
            "policy_version": self.policy_version,
            "episodes_offered": len(self.offers),
            "calls_in_flight": len(self.calls.in_flight),
            "chat_template": self.template_problem or "append-only",
            "counts": dict(self.counts),
        }

    def counters(self) -> dict[str, int]:
        return dict(self.counts)


def _context_length(path, config: RunConfig) -> int:
    """The longest prompt and answer the generators can sample: the engine's max_model_len, else the model's own."""
    if config.generation.vllm.max_model_len is not None:
        return config.generation.vllm.max_model_len
    model = AutoConfig.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)
    return int(getattr(model, "max_position_embeddings", None) or 4096)
