"""The OpenAI-compatible HTTP API (aiohttp): completions, chat completions, models, health, metrics.

Contract: handlers are small async functions over one `EngineWorker`; requests from all clients
are batched together by the engine. Every client mistake (malformed JSON, wrong types, unknown
model, prompt over the context window, absurd max_tokens, n > 1, a body over `MAX_BODY_BYTES`) is
answered with an OpenAI-style JSON error and a 4xx status (`specd.serving.http.fields` checks each
field), mapped in one place (`_errors` middleware, which also maps every other `SpecdError` to its
kind's status); a 500 is only ever an engine fault, and it carries a message, not a traceback.
One client cannot stall or harm another: bodies are parsed and prompts tokenised off the event
loop, and a client that goes away (streaming or not) has its request cancelled, freeing its batch
slot at the engine's next step. `stream: true` sends server-sent events (`data: {chunk}` lines,
then `data: [DONE]`), their text detokenised incrementally (`specd.serving.http.detokenize`); with
`stream_options: {"include_usage": true}` the last chunk before `[DONE]` carries the token
counts, as OpenAI's does. A server that stops lets requests in flight finish for
`ApiState.shutdown_grace_s`, then ends the rest with a 503 that says so (`_drain`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from specd.core.errors import InternalError, SpecdError
from specd.core.http_requests import bearer_matches, json_object_off_loop, read_body
from specd.engine.request import SamplingParams, Sequence
from specd.engine.worker import EngineWorker, Failure, Submission
from specd.model.target import LoadedTarget
from specd.serving.http import fields
from specd.serving.http.detokenize import IncrementalDetokenizer, StopStrings
from specd.serving.http.fields import MAX_TOKENS_CAP, ApiError
from specd.serving.http.metrics import ServingMetrics

__all__ = ["MAX_TOKENS_CAP", "STATE", "ApiError", "ApiState", "create_app"]

MAX_BODY_BYTES = 8 * 1024 * 1024   # a 4096-token context needs far less; larger bodies get a 413
CONNECTION_CHECK_S = 0.05          # how often a request waiting for tokens checks that its client is there
SHUTTING_DOWN = "the server is shutting down; send the request again (to another replica)"


def _check_capacity(state: ApiState) -> None:
    """Overload gets a clear answer: beyond `max_queued` waiting requests, a 429 with Retry-After
    (and a stopping server a 503)."""
    if state.draining:
        raise ApiError(503, SHUTTING_DOWN, code="server_shutting_down", kind="server_error",
                       headers={"Retry-After": "1"})
    if state.max_queued is not None and state.worker.queued >= state.max_queued:
        raise ApiError(429, f"the server is busy: {state.max_queued} requests are already waiting; retry shortly",
                       code="rate_limit_exceeded", kind="rate_limit_error", headers={"Retry-After": "1"})


@dataclass
class ApiState:
    loaded: LoadedTarget
    worker: EngineWorker
    metrics: ServingMetrics
    model_name: str
    status: Callable[[], dict[str, Any]] | None = None  # extra fields for /health
    max_queued: int | None = None  # requests waiting for a batch slot beyond which new ones get a 429
    domains: set[str] = field(default_factory=set)  # the client-chosen domain labels seen, at most MAX_DOMAINS
    api_key: str | None = None  # when set, the OpenAI routes need `Authorization: Bearer <api_key>`
    shutdown_grace_s: float = 10.0  # how long a stopping server lets requests in flight finish
    draining: bool = False  # stopping: new requests get a 503
    streams: set[_Stream] = field(default_factory=set)  # the requests in flight


log = logging.getLogger(__name__)
STATE = web.AppKey("state", ApiState)
MAX_DOMAINS = 32
OTHER_DOMAIN = "other"


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(request)
    except SpecdError as error:  # the API's own refusals and every kind from the layers below
        return web.json_response(error.as_json(), status=error.http_status,
                                 headers=getattr(error, "headers", None))
    except web.HTTPException as error:  # aiohttp's own 404 / 405, in OpenAI's shape
        body = {"error": {"message": error.reason, "type": "invalid_request_error", "param": None, "code": None}}
        allow = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else None  # a 405's methods
        return web.json_response(body, status=error.status, headers=allow)
    except Exception:  # a bug: its traceback in the log, a JSON 500 to the client (never aiohttp's text page)
        log.exception("%s %s failed", request.method, request.path)
        return web.json_response(InternalError().as_json(), status=InternalError.http_status)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        raw = await read_body(request)
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body is over this server's limit of {request.client_max_size} bytes",
                       code="request_too_large") from None
    return await json_object_off_loop(raw)


# ---- decoding ---------------------------------------------------------------------------------
class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


def _client_gone(request: web.Request) -> bool:
    transport = request.transport  # None once aiohttp has seen the connection close
    return transport is None or transport.is_closing()


class _Stream:
    """Tokens from the engine thread to one request's coroutine, as text cut at stop strings."""

    def __init__(self, state: ApiState, request: web.Request, prompt_ids: list[int], params: SamplingParams,
                 stops: list[str], domain: str | None) -> None:
        self.state, self.request = state, request
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.request_id = f"specd-{uuid.uuid4().hex[:16]}"
        self.detokenizer = IncrementalDetokenizer(state.loaded.decode)
        self.stops = StopStrings(stops)
        self.finish_reason: str | None = None
        self.seq: Sequence | None = None

        def put(kind: str) -> Callable[[Any], None]:
            def hand_over(value: Any) -> None:
                self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
            return hand_over

        state.worker.submit(Submission(prompt_ids, params, put("tokens"), put("done"), put("error"),
                                       domain=domain, request_id=self.request_id))
        state.streams.add(self)

    def cut_short(self, failure: Failure) -> None:
        """End this request with an error now (a server that stops): a JSON error if nothing was
        sent yet, else an error event and [DONE] in its stream."""
        self.events.put_nowait(("error", failure))

    @property
    def ids(self) -> list[int]:
        """The output token ids received so far."""
        return self.detokenizer.ids

    async def _next_event(self) -> tuple[str, Any]:
        """The engine's next report; raises ClientGone as soon as the client has closed its connection
        (checked at every report, so at every step while decoding, and every CONNECTION_CHECK_S while queued)."""
        while True:
            if _client_gone(self.request):
                raise ClientGone
            try:
                async with asyncio.timeout(CONNECTION_CHECK_S):
                    return await self.events.get()
            except TimeoutError:
                continue

    async def deltas(self, streamed: bool) -> AsyncGenerator[str, None]:
        """Yield text pieces as they are decoded; sets finish_reason at the end. The first tokens'
        wait is time to first token; later gaps, per token, are inter-token latency when `streamed`."""
        last, first = time.perf_counter(), True
        while True:
            kind, value = await self._next_event()
            if kind == "error":
                failure: Failure = value
                raise ApiError(failure.status, failure.message, param=failure.param, code=failure.code,
                               kind="invalid_request_error" if failure.status < 500 else "server_error")
            if kind == "tokens":
                now = time.perf_counter()
                self.state.metrics.observe_tokens(now - last, len(value), first, streamed)
                last, first = now, False
                text = self._feed(value)
            else:  # done: every token was reported before, but take any the report did not carry
                self.seq = value
                text = self._feed(value.output_ids[len(self.ids):])
                text += self.stops.feed(self.detokenizer.finish()) + self.stops.finish()
            if self.stops.is_stopped:
                self.finish_reason = "stop"
                # tokens past the stop string are not wanted; the request is still served traffic
                self.state.worker.cancel(self.request_id, answered=True)
            elif kind == "done":
                self.finish_reason = "length" if value.finish_reason == "length" else "stop"
            if text:
                yield text
            if self.finish_reason is not None:
                return

    def _feed(self, ids: list[int]) -> str:
        """The text of `ids`, up to a stop string. With stop strings the ids go in one at a time and
        none after the one that completed a stop string: `ids` (and the usage) count the answer's
        tokens only, not the rest of the step that decoded it."""
        if not self.stops.stops:
            return self.stops.feed(self.detokenizer.push(ids))
        pieces = []
        for token in ids:
            if self.stops.is_stopped:
                break
            pieces.append(self.stops.feed(self.detokenizer.push([token])))
        return "".join(pieces)

    def abandon(self) -> None:
        """Cancel the request unless it ended: its client is gone or its answer failed midway."""
        self.state.streams.discard(self)
        if self.finish_reason is None:
            self.state.worker.cancel(self.request_id)


def _domain(state: ApiState, request: web.Request, body: dict[str, Any]) -> str | None:
    """The traffic domain a client labels its request with: OpenAI `metadata.domain` or X-Specd-Domain.

    Labels become metric labels and report keys, so their number is bounded: after MAX_DOMAINS
    distinct ones, any new label is counted as OTHER_DOMAIN."""
    metadata = body.get("metadata")
    domain = metadata.get("domain") if isinstance(metadata, dict) else None
    if domain is not None and not isinstance(domain, str):
        raise ApiError(400, f"'metadata.domain' must be a string, got {type(domain).__name__}", param="metadata")
    domain = domain or request.headers.get("X-Specd-Domain")
    if not domain:
        return None
    # a label travels on as UTF-8 (reports, records, dashboards): a lone surrogate from JSON becomes '?'
    label = domain[:64].encode("utf-8", "replace").decode("utf-8")
    if label not in state.domains:
        if len(state.domains) >= MAX_DOMAINS:
            return OTHER_DOMAIN
        state.domains.add(label)
    return label


async def _respond(request: web.Request, body: dict[str, Any], state: ApiState, prompt_ids: list[int],
                   params: SamplingParams, stops: list[str], stream: bool, chat: bool) -> web.StreamResponse:
    include_usage = stream and fields.include_usage(body)
    _check_capacity(state)  # again: others may have queued while this prompt was being tokenised
    begin = time.perf_counter()
    decoder = _Stream(state, request, prompt_ids, params, stops, _domain(state, request, body))
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    base = {"id": decoder.request_id, "created": created, "model": state.model_name}

    def choice(text: str, finish: str | None, delta: bool) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        message = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": 0, ("delta" if delta else "message"): message, "finish_reason": finish}

    def usage() -> dict[str, int]:
        return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(decoder.ids),
                "total_tokens": len(prompt_ids) + len(decoder.ids)}

    response: web.StreamResponse | None = None
    try:
        if not stream:
            text = "".join([piece async for piece in decoder.deltas(streamed=False)])
            state.metrics.request_latency.observe(time.perf_counter() - begin)
            return web.json_response({**base, "object": kind, "usage": usage(),
                                      "choices": [choice(text, decoder.finish_reason, False)]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        async with contextlib.aclosing(decoder.deltas(streamed=True)) as pieces:
            first = await anext(pieces, "")  # errors before the first token still get a JSON error
            await response.prepare(request)
            try:
                if chat:
                    await send({**base, "object": chunk_kind, "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
                if first:
                    await send({**base, "object": chunk_kind, "choices": [choice(first, None, True)]})
                async for piece in pieces:
                    await send({**base, "object": chunk_kind, "choices": [choice(piece, None, True)]})
                await send({**base, "object": chunk_kind, "choices": [choice("", decoder.finish_reason, True)]})
                if include_usage:
                    await send({**base, "object": chunk_kind, "choices": [], "usage": usage()})
                await send("[DONE]")
            except ApiError as error:  # an engine fault once the stream began: say so in it, then end it
                await send(error.as_json())
                await send("[DONE]")
        state.metrics.request_latency.observe(time.perf_counter() - begin)
        return response
    except (ClientGone, ConnectionError):
        # nobody reads the answer any more; aiohttp ignores a failed write of this one
        return response if response is not None else web.Response(status=499, reason="Client Closed Request")
    finally:
        decoder.abandon()  # frees the batch slot of a request cut short (client gone, handler cancelled)


# ---- handlers ---------------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _json_body(request)
    fields.check_model(body, state.model_name)
    params, stops, stream = fields.sampling(body, default_max_tokens=16)
    _check_capacity(state)  # before tokenising: an overloaded server refuses cheaply
    # tokenising a long prompt takes a while: off the loop, other clients' streams keep flowing
    prompt_ids = await asyncio.to_thread(fields.completion_prompt_ids, state.loaded, body.get("prompt"))
    return await _respond(request, body, state, prompt_ids, params, stops, stream, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _json_body(request)
    fields.check_model(body, state.model_name)
    params, stops, stream = fields.sampling(body, default_max_tokens=256)
    _check_capacity(state)
    prompt_ids = await asyncio.to_thread(fields.chat_prompt_ids, state.loaded, body.get("messages"))
    return await _respond(request, body, state, prompt_ids, params, stops, stream, chat=True)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": 0, "owned_by": "specd",
         "max_model_len": state.worker.engine.max_context}]})


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.worker.engine
    body = {"status": "ok", "drafter_version": engine.drafter_version, "running": len(engine.running),
            "waiting": len(engine.waiting)}
    if state.status is not None:
        body.update(state.status())
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[STATE].metrics.exposition(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models")


@web.middleware
async def _api_key(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
    """As vLLM's `--api-key`: the OpenAI routes answer only requests that carry the key (an empty key,
    as `SPECD_API_KEY=` gives, is no key: the routes are open)."""
    key = request.app[STATE].api_key
    if key and request.path in OPENAI_ROUTES \
            and not bearer_matches(request.headers.get("Authorization", ""), key):
        raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>", code="invalid_api_key",
                       kind="authentication_error")
    return await handler(request)


async def _drain(app: web.Application) -> None:
    """A stopping server (aiohttp's shutdown, before it waits for handlers): new requests get a 503,
    those in flight have `shutdown_grace_s` to finish, and the rest end with a 503 error (in their
    stream if it began) rather than being cut off without a word."""
    state = app[STATE]
    state.draining = True
    deadline = time.monotonic() + state.shutdown_grace_s
    while state.streams and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.streams:
        log.warning("stopping: %d requests still in flight after %.0f s are ended with a 503",
                    len(state.streams), state.shutdown_grace_s)
    for stream in list(state.streams):
        stream.cut_short(Failure(503, SHUTTING_DOWN, code="server_shutting_down"))


def create_app(state: ApiState) -> web.Application:
    app = web.Application(middlewares=[_errors, _api_key], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.on_shutdown.append(_drain)
    app.router.add_post(OPENAI_ROUTES[0], completions)
    app.router.add_post(OPENAI_ROUTES[1], chat_completions)
    app.router.add_get(OPENAI_ROUTES[2], models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
