"""The gateway's HTTP API in OpenAI's shapes: what a request may hold, what an answer and an error look like.

The requests are read leniently, as OpenAI's server reads them (unknown fields are ignored), but what the gateway
cannot honour is refused with the reason: ``n`` > 1 (a call is one turn of its episode), batched prompts, ``echo``,
``suffix``. Sampling follows the run (``generation.temperature``, ``top_p``, ``top_k``): the learner's log-probs are of
that distribution, so a client's own settings would make every ratio wrong; ``max_tokens`` is capped by
``generation.max_new_tokens``, and ``stop`` is the client's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "ApiError",
    "Answer",
    "ChatRequest",
    "ClaimRequest",
    "CompletionsRequest",
    "EndRequest",
    "RewardRequest",
    "chat_answer",
    "chat_chunks",
    "completion_answer",
    "completion_chunks",
    "error_body",
    "parse",
]

MAX_STOPS = 16
# The largest reward the API takes, one post's or an episode's sum. Rewards travel as float32 (a 1e39 was infinity
# there, and its group could never be encoded); far inside that range a sum of them stays finite, and past ~1e6 a
# float32 keeps no fraction of it anyway.
MAX_REWARD = 1e6
# The roles a chat message may have, as OpenAI's API takes them.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "invalid_request_error",
        409: "invalid_request_error",
        413: "invalid_request_error",
        503: "server_error",
        500: "server_error",
    }

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        return error_body(self.message, self.TYPES.get(self.status, "invalid_request_error"), self.code, self.param)


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI's server does; known ones are taken as their JSON type only (strict): a
    # "max_tokens": "12" is refused as OpenAI refuses it, not read as 12.
    model_config = ConfigDict(extra="ignore", strict=True)


class _Sampled(_Request):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    seed: int | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("n must be 1: each call is one turn of its episode (call again for another sample)")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop: at most {MAX_STOPS} non-empty strings")
        return stops

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def usage_streamed(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatRequest(_Sampled):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages):
        for i, message in enumerate(messages):
            role = message.get("role")
            if not isinstance(role, str):
                raise ValueError(f"messages[{i}] has no role")
            if role not in ROLES:
                raise ValueError(f"messages[{i}].role: {role[:40]!r} is not one of {', '.join(ROLES)}")
            if "content" not in message and not (role == "assistant" and message.get("tool_calls")):
                raise ValueError(f"messages[{i}] has no content (only an assistant's tool calls may go without)")
            content = message.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(
                    isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
                ):
                    raise ValueError(f"messages[{i}].content: only text parts are served")
                message["content"] = "".join(part["text"] for part in content)
            elif content is not None and not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string, text parts or null")
        return messages

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools):
        for i, tool in enumerate(tools or []):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict):
                raise ValueError(f"tools[{i}] is not a tool: {{'type': 'function', 'function': {{'name': ...}}}}")
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise ValueError(f"tools[{i}].function has no name")
            if not isinstance(function.get("parameters", {}), dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON schema (an object)")
        return tools

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionsRequest(_Sampled):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt):
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not served: the prompt is the client's own")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix:
            raise ValueError("suffix is not served")
        return suffix

    @property
    def limit(self) -> int | None:
        return self.max_tokens


class ClaimRequest(_Request):
    agent: str = Field("agent", max_length=200)
    wait_s: float = Field(10.0, ge=0, le=60)


class RewardRequest(_Request):
    reward: float | None = None
    rewards: list[float] | None = None  # one per call (summed, as an environment's step rewards are)
    done: bool = True

    def total(self) -> float:
        if (self.reward is None) == (self.rewards is None):
            raise ValueError("give reward (one outcome) or rewards (one per call)")
        values = [self.reward] if self.reward is not None else self.rewards
        if not all(isinstance(v, float | int) and v == v and abs(v) != float("inf") for v in values):
            raise ValueError("rewards must be finite numbers")
        total = float(sum(values))
        if not all(abs(v) <= MAX_REWARD for v in values) or abs(total) > MAX_REWARD:
            raise ValueError(f"a reward, and an episode's sum of them, lies within ±{MAX_REWARD:g}")
        return total


class EndRequest(_Request):
    outcome: Literal["ended", "failed"] = "ended"
    detail: str = Field("", max_length=2000)


def parse(model: type[BaseModel], body: bytes):
    """The request ``body`` as ``model``; :class:`ApiError` 400 for what is not JSON or not such a request."""
    try:
        data = json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not JSON: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], "invalid_request", where) from None


@dataclass(frozen=True)
class Answer:
    """One call answered: what the client gets back (made from the call's event on the log)."""

    call: str
    model: str
    text: str
    finish_reason: str
    prompt_tokens: int
    tokens: list[str]  # each sampled token as text (for logprobs)
    logprobs: list[float]
    created: int

    @property
    def usage(self) -> dict:
        completion = len(self.logprobs)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    @property
    def id(self) -> str:
        return "call-" + self.call


def chat_answer(answer: Answer, logprobs: bool) -> dict:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": answer.text},
        "finish_reason": answer.finish_reason,
        "logprobs": _chat_logprobs(answer) if logprobs else None,
    }
    return {
        "id": answer.id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [choice],
        "usage": answer.usage,
    }


def chat_chunks(answer: Answer, logprobs: bool, usage: bool) -> list[dict]:
    """The answer as a stream's chunks (it is on the log whole before the first is sent)."""
    head = {"id": answer.id, "object": "chat.completion.chunk", "created": answer.created, "model": answer.model}
    chunks = [
        head
        | {
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": answer.text},
                    "logprobs": _chat_logprobs(answer) if logprobs else None,
                    "finish_reason": None,
                }
            ]
        },
        head | {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": answer.finish_reason}]},
    ]
    if usage:
        chunks.append(head | {"choices": [], "usage": answer.usage})
    return chunks


def completion_answer(answer: Answer, logprobs: int | None) -> dict:
    choice = {
        "index": 0,
        "text": answer.text,
        "finish_reason": answer.finish_reason,
        "logprobs": _completion_logprobs(answer) if logprobs is not None else None,
    }
    return {
        "id": answer.id,
        "object": "text_completion",
        "created": answer.created,
        "model": answer.model,
        "choices": [choice],
        "usage": answer.usage,
    }


def completion_chunks(answer: Answer, logprobs: int | None, usage: bool) -> list[dict]:
    head = {"id": answer.id, "object": "text_completion", "created": answer.created, "model": answer.model}
    chunks = [
        head
        | {
            "choices": [
                {
                    "index": 0,
                    "text": answer.text,
                    "finish_reason": None,
                    "logprobs": _completion_logprobs(answer) if logprobs is not None else None,
                }
            ]
        },
        head | {"choices": [{"index": 0, "text": "", "finish_reason": answer.finish_reason, "logprobs": None}]},
    ]
    if usage:
        chunks.append(head | {"choices": [], "usage": answer.usage})
    return chunks


def _chat_logprobs(answer: Answer) -> dict:
    return {
        "content": [
            {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
            for token, logprob in zip(answer.tokens, answer.logprobs)
        ]
    }


def _completion_logprobs(answer: Answer) -> dict:
    return {"tokens": answer.tokens, "token_logprobs": answer.logprobs, "top_logprobs": None, "text_offset": None}


def now() -> int:
    return int(time.time())
