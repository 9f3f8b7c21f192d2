"""The gateway's HTTP server: FastAPI on uvicorn, in a thread of the gateway's process.

Handlers read and check a request (its size, its JSON, its shape), hand it to the gateway's loop as a
:class:`Request` and wait for the answer; everything about episodes happens in that loop (the service's thread), so
nothing here is shared but the queue. Errors are OpenAI's shape (``{"error": {...}}``), retryable ones (503) with
``Retry-After`` and ``x-should-retry: true``, the headers OpenAI's clients follow.

Routes (``KEY`` is an episode's key, which its base URL and its API key carry):

- ``POST /episodes/KEY/v1/chat/completions``, ``POST /episodes/KEY/v1/completions``, ``GET /episodes/KEY/v1/models``;
  the same under ``/v1/...`` with ``Authorization: Bearer KEY``;
- ``POST /episodes/claim``: an agent takes the next episode (waits up to ``wait_s``; 204 when none came);
- ``POST /episodes/KEY/reward`` (``{"reward": r}`` or ``{"rewards": [...]}``, ``"done"``), ``POST /episodes/KEY/end``;
- ``GET /health``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.api import (
    Answer,
    ApiError,
    ChatRequest,
    ClaimRequest,
    CompletionsRequest,
    EndRequest,
    RewardRequest,
    chat_answer,
    chat_chunks,
    completion_answer,
    completion_chunks,
    parse,
)

log = logging.getLogger(__name__)

__all__ = ["GatewayServer", "Request", "bind_first_free"]

RETRY_AFTER_S = 1


@dataclass
class Request:
    """One request for the gateway's loop; :meth:`answer` sends the reply back to the waiting handler."""

    kind: str  # "chat" | "completion" | "claim" | "reward" | "end"
    key: str | None  # the episode's key, from the path or the API key (unchecked)
    body: Any  # the parsed body (api.*Request)
    idempotency_key: str | None = None
    retries: int = 0  # the client's retry of a call it got no answer to (x-stainless-retry-count)
    received: float = field(default_factory=time.monotonic)
    reply: Callable[[Any], None] = lambda result: None
    caught_up: bool = False  # the loop read the episodes log to its end for it

    def answer(self, result: Answer | dict | ApiError | None) -> None:
        self.reply(result)


def bind_first_free(host: str, ports: str) -> socket.socket:
    """A listening socket on the first free port of ``ports`` (``"8400"``, ``"8400-8431"``, ``"0"``: any)."""
    first, _, last = ports.partition("-")
    candidates = range(int(first), int(last or first) + 1)
    errors = []
    for port in candidates:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            errors.append(f"{port}: {exc.strerror}")
            continue
        sock.listen(256)
        return sock
    raise OSError(f"gateway.port {ports}: no port free on {host} ({'; '.join(errors[:3])})")


class GatewayServer:
    """The HTTP server, started in a thread; requests go to ``inbox`` (a :class:`queue.Queue` of :class:`Request`)."""

    def __init__(
        self,
        host: str,
        ports: str,
        inbox: queue.Queue,
        model_name: str,
        max_request_bytes: int,
        answer_within_s: float,
        health: Callable[[], dict],
    ):
        self.inbox, self.model_name, self.max_bytes = inbox, model_name, max_request_bytes
        self.answer_within_s, self.health = answer_within_s, health
        self.socket = bind_first_free(host, ports)
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(
            self._app(), log_level="warning", access_log=False, timeout_keep_alive=75, timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="gateway-http", daemon=True
        )

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the gateway's HTTP server did not start on port {self.port}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.socket.close()

    # ------------------------------------------------------------------ the app

    def _app(self) -> FastAPI:
        app = FastAPI(title="streamppo gateway", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(StarletteHTTPException)
        async def not_served(request: HttpRequest, exc: StarletteHTTPException):
            return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", "not_found"))

        @app.exception_handler(Exception)
        async def failed(request: HttpRequest, exc: Exception):
            log.exception("gateway: %s %s failed", request.method, request.url.path)
            return _error(ApiError(500, f"the gateway failed: {type(exc).__name__}: {exc}", "internal_error"))

        @app.get("/health")
        async def health():
            return self.health()

        @app.get("/v1/models")
        @app.get("/episodes/{key}/v1/models")
        async def models(key: str | None = None):
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "streamppo"}]}

        @app.post("/v1/chat/completions")
        @app.post("/episodes/{key}/v1/chat/completions")
        async def chat(request: HttpRequest, key: str | None = None):
            return await self._call(request, "chat", key, ChatRequest)

        @app.post("/v1/completions")
        @app.post("/episodes/{key}/v1/completions")
        async def completions(request: HttpRequest, key: str | None = None):
            return await self._call(request, "completion", key, CompletionsRequest)

        @app.post("/episodes/claim")
        async def claim(request: HttpRequest):
            return await self._call(request, "claim", None, ClaimRequest)

        @app.post("/episodes/{key}/reward")
        async def reward(request: HttpRequest, key: str):
            return await self._call(request, "reward", key, RewardRequest)

        @app.post("/episodes/{key}/end")
        async def end(request: HttpRequest, key: str):
            return await self._call(request, "end", key, EndRequest)

        return app

    async def _call(self, request: HttpRequest, kind: str, key: str | None, model) -> Response:
        try:
            body = parse(model, await self._body(request))
            if key is None and kind in ("chat", "completion"):
                key = _bearer(request)
            result = await self._ask(
                Request(
                    kind,
                    key,
                    body,
                    idempotency_key=request.headers.get("idempotency-key"),
                    retries=_int(request.headers.get("x-stainless-retry-count")),
                ),
                wait_s=self.answer_within_s + getattr(body, "wait_s", 0.0),
            )
        except ApiError as exc:
            return _error(exc)
        if result is None:
            return Response(status_code=204)
        if isinstance(result, dict):
            return JSONResponse(result)
        return _answered(kind, body, result)

    async def _body(self, request: HttpRequest) -> bytes:
        declared = _int(request.headers.get("content-length"), -1)
        if declared > self.max_bytes:
            raise ApiError(413, f"the body of {declared} bytes is over the limit of {self.max_bytes}", "too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_bytes:
                raise ApiError(413, f"the body is over the limit of {self.max_bytes} bytes", "too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _ask(self, request: Request, wait_s: float):
        """Hand ``request`` to the gateway's loop and wait for its answer."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def reply(result) -> None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

        request.reply = reply
        self.inbox.put(request)
        try:
            result = await asyncio.wait_for(future, timeout=wait_s)
        except TimeoutError:
            raise ApiError(503, f"no answer within {wait_s:.0f} s; try again", "timeout") from None
        if isinstance(result, ApiError):
            raise result
        return result


def _answered(kind: str, body, answer: Answer) -> Response:
    if kind == "chat":
        if not body.stream:
            return JSONResponse(chat_answer(answer, body.logprobs))
        chunks = chat_chunks(answer, body.logprobs, body.usage_streamed)
    else:
        if not body.stream:
            return JSONResponse(completion_answer(answer, body.logprobs))
        chunks = completion_chunks(answer, body.logprobs, body.usage_streamed)

    async def events():
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _error(exc: ApiError) -> JSONResponse:
    headers = {"x-should-retry": "true" if exc.status >= 500 else "false"}
    if exc.status == 503:
        headers["retry-after"] = str(RETRY_AFTER_S)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _bearer(request: HttpRequest) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "no API key: use the episode's base URL, or its key as the API key", "invalid_api_key")
    return token.strip()


def _int(value: str | None, default: int = 0) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
