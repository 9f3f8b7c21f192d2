"""The messages of multi-turn episodes: a generator's turn and the environment's reply, an agent's call through the
gateway and its completion, and the episode's events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from common.schema.base import BatchMessage
from common.schema.wire import (
    SchemaError,
    StringList,
    array,
    group_key,
    scalar,
    wire_field,
)


def episode_key(step: int, row: int, index: int) -> str:
    """An episode's id: its group's key and its index among the group's responses."""
    return f"{group_key(step, row)}#{index}"


@dataclass
class EpisodeTurn(BatchMessage):
    SCHEMA: ClassVar[str] = "turns"
    DOC: ClassVar[str] = (
        "One model turn of a multi-turn episode, for an environment replica to answer: the episode so far as text "
        "(the prompt, the model's turns, the environment's observations), so that any replica can answer it, one "
        "that never saw the episode by replaying its earlier turns."
    )

    episode: str = scalar("str", "The episode: '<step>/<row>#<index>', its group's key and its index in the group.")
    turn: int = scalar("int", "Which of the model's turns this is (0 for the first).")
    reply_to: str = scalar(
        "str",
        "The generator process waiting for the answer ('<replica>/<incarnation>'); an answer for another is "
        "ignored, so a restarted generator never takes an answer meant for its predecessor.",
    )
    prompt_text: str = scalar("str", "The episode's prompt, as text.")
    prompt_label: str = scalar("str", "The dataset row's label ('' where it has none).")
    model_turns: list = wire_field(StringList("K", "The model's turns so far, as text; the last is the one to answer."))
    observations: list = wire_field(StringList("J", "The environment's answers to the earlier turns (J = K − 1)."))

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        super().check(values, dims)
        if dims["K"] != values["turn"] + 1 or dims["J"] != dims["K"] - 1:
            raise SchemaError(
                f"{cls.SCHEMA}: turn {values['turn']} needs {values['turn'] + 1} model turns and {values['turn']} "
                f"observations, not {dims['K']} and {dims['J']}"
            )

    @property
    def rows(self) -> int:
        return 1

    def idempotency_keys(self) -> list[str]:
        return [f"{self.reply_to}|{self.episode}.{self.turn}"]


@dataclass
class EnvironmentReply(BatchMessage):
    SCHEMA: ClassVar[str] = "observations"
    DOC: ClassVar[str] = "An environment's answer to one model turn of an episode (turns): what the model reads next."

    episode: str = scalar("str", "The episode (as in the turn answered).")
    turn: int = scalar("int", "The turn answered.")
    reply_to: str = scalar("str", "The generator process that asked (as in the turn).")
    observation: str = scalar("str", "Text appended after the model's turn, never trained on ('' when done).")
    reward: float = scalar("float", "The environment's reward for the turn.")
    done: bool = scalar("bool", "Whether the episode is over.")
    status: str = scalar(
        "str", "'ok', or why the environment could not step (it then ends the episode): the error, in one line."
    )

    @property
    def rows(self) -> int:
        return 1

    def idempotency_keys(self) -> list[str]:
        return [f"{self.reply_to}|{self.episode}.{self.turn}"]


# ------------------------------------------------------------------ an agent's calls through the gateway


@dataclass
class CompletionRequest(BatchMessage):
    SCHEMA: ClassVar[str] = "requests"
    DOC: ClassVar[str] = (
        "One call of an agent's episode, from a gateway to the generator fleet: the whole prompt as token ids, to be "
        "answered with one response on completions. The batch id is the call's id."
    )

    episode: str = scalar("str", "The episode: '<step>/<row>#<index>', its group's key and its index in the group.")
    call: str = scalar("str", "The call's id, unique in the run ('<episode>/<key>'); the answer carries it.")
    reply_to: str = scalar(
        "str",
        "The gateway process waiting for the answer ('<replica>/<incarnation>'); an answer for another is ignored, so "
        "a restarted gateway never takes one meant for its predecessor.",
    )
    prompt_tokens: np.ndarray = array("int64", "P", doc="The prompt's token ids, whole.")
    max_tokens: int = scalar("int", "The most tokens the response may have.")
    temperature: float = scalar("float", "Sampling temperature (> 0).")
    top_p: float = scalar("float", "Nucleus sampling's mass, in (0, 1].")
    top_k: int = scalar("int", "Top-k sampling; 0: off.")
    seed: int = scalar("int", "The call's sampling seed; -1: none (the engine's own randomness).")
    stop: list = wire_field(StringList("S", "Strings that end the response besides EOS (kept in its tokens)."))

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        super().check(values, dims)
        if dims["P"] == 0 or values["max_tokens"] < 1:
            raise SchemaError(f"{cls.SCHEMA}: a request needs a prompt and max_tokens of at least 1")
        if not (values["temperature"] > 0 and 0 < values["top_p"] <= 1 and values["top_k"] >= 0):
            raise SchemaError(f"{cls.SCHEMA}: temperature must be > 0, top_p in (0, 1], top_k >= 0")

    @property
    def rows(self) -> int:
        return 1

    def idempotency_keys(self) -> list[str]:
        return [f"{self.reply_to}|{self.call}"]


@dataclass
class Completion(BatchMessage):
    SCHEMA: ClassVar[str] = "completions"
    DOC: ClassVar[str] = (
        "A generator's answer to one request (requests): the sampled token ids with their behaviour log-probs and the "
        "policy version that sampled each. The header's policy_version is the oldest of them."
    )

    episode: str = scalar("str", "The episode (as in the request).")
    call: str = scalar("str", "The call answered (as in the request).")
    reply_to: str = scalar("str", "The gateway process that asked (as in the request).")
    response_tokens: np.ndarray = array("int64", "T", doc="The sampled token ids, EOS or the stop string included.")
    behaviour_logprobs: np.ndarray = array(
        "float32", "T", doc="log π_behaviour of each sampled token at the sampling temperature."
    )
    token_versions: np.ndarray = array("int32", "T", doc="The policy version that sampled each token.")
    text: str = scalar(
        "str",
        "The response as the client reads it: decoded without special tokens, cut before the first stop string.",
    )
    finish_reason: str = scalar("str", "'stop' (EOS or a stop string), 'length' (max_tokens), or 'error' (see status).")
    status: str = scalar(
        "str", "'ok', or why the request could not be sampled (a prompt longer than the engine takes), in one line."
    )

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        super().check(values, dims)
        versions = values["token_versions"]
        if versions.size and int(versions.min()) != values["policy_version"]:
            raise SchemaError(f"{cls.SCHEMA}: policy_version is not the oldest of token_versions")
        if values["finish_reason"] not in ("stop", "length", "error"):
            raise SchemaError(f"{cls.SCHEMA}: finish_reason must be stop, length or error")

    @property
    def rows(self) -> int:
        return 1

    def idempotency_keys(self) -> list[str]:
        return [f"{self.reply_to}|{self.call}"]


EPISODE_EVENTS = ("start", "call", "reward", "end")
EPISODE_OUTCOMES = ("rewarded", "ended", "failed", "timed_out")


@dataclass
class EpisodeEvent(BatchMessage):
    SCHEMA: ClassVar[str] = "episodes"
    DOC: ClassVar[str] = (
        "The gateways' log of agents' episodes, one event at a time, in order per episode (its step picks the "
        "partition): an agent took the episode (start), one call answered (call, written before the answer is "
        "returned), a reward posted (reward), the episode over (end). Any gateway replica rebuilds an episode from "
        "it; the one that holds the episode's prompt batch turns its calls into rollouts once every episode of a group "
        "has ended. The batch id is the episode's prompt batch's."
    )

    episode: str = scalar("str", "The episode: '<step>/<row>#<index>'.")
    kind: str = scalar("str", "'start', 'call', 'reward' or 'end'.")
    event: str = scalar("str", "The event's id, unique in the run: a call's id for a call.")
    parent: str = scalar(
        "str",
        "call: the earlier call whose prompt and response this call's prompt extends (its tokens are reused as they "
        "are); '' when it extends none and begins a new row of the episode.",
    )
    request_digest: str = scalar(
        "str",
        "call: a digest of the request as the client sent it (model, messages or prompt, limits): a retry's is "
        "the same.",
    )
    messages: int = scalar("int", "call: the messages of its chat (0 for a prompt of the completions API).")
    prompt_text: str = scalar(
        "str", "call: the prompt's text after the parent's response (the whole prompt without a parent)."
    )
    prompt_tokens: np.ndarray = array(
        "int64",
        "P",
        doc="call: the prompt's token ids after the parent's response (the whole prompt without a parent).",
    )
    response_tokens: np.ndarray = array("int64", "T", doc="call: the sampled token ids.")
    behaviour_logprobs: np.ndarray = array("float32", "T", doc="call: their behaviour log-probs.")
    token_versions: np.ndarray = array("int32", "T", doc="call: the policy version that sampled each.")
    text: str = scalar("str", "call: the response as the client read it.")
    finish_reason: str = scalar("str", "call: 'stop' or 'length'.")
    reward: float = scalar("float", "reward: the reward posted; end: the reward it ends with (see outcome).")
    outcome: str = scalar(
        "str",
        "end: 'rewarded' (a reward was posted), 'ended' (the agent ended it without one), 'failed' (the agent failed), "
        "'timed_out' (nothing came for gateway.episode_timeout_s); the gateway's unrewarded policy says what becomes "
        "of all but the first.",
    )
    detail: str = scalar("str", "start: the agent that took it; end: why it ended ('' when the agent ended it).")

    @classmethod
    def check(cls, values: dict, dims: dict[str, int]) -> None:
        super().check(values, dims)
        kind = values["kind"]
        if kind not in EPISODE_EVENTS:
            raise SchemaError(f"{cls.SCHEMA}: kind must be one of {', '.join(EPISODE_EVENTS)}, not {kind!r}")
        if kind != "call" and (dims["P"] or dims["T"]):
            raise SchemaError(f"{cls.SCHEMA}: a {kind} event carries no tokens")
        if kind == "call" and values["finish_reason"] not in ("stop", "length"):
            raise SchemaError(f"{cls.SCHEMA}: a call's finish_reason must be stop or length")
        versions = values["token_versions"]
        if versions.size and int(versions.min()) != values["policy_version"]:
            raise SchemaError(f"{cls.SCHEMA}: policy_version is not the oldest of token_versions")
        if kind == "end" and values["outcome"] not in EPISODE_OUTCOMES:
            raise SchemaError(f"{cls.SCHEMA}: an end's outcome must be one of {', '.join(EPISODE_OUTCOMES)}")

    @property
    def rows(self) -> int:
        return 1

    def idempotency_keys(self) -> list[str]:
        return [self.event]
