"""The OpenAI-compatible HTTP API (aiohttp): completions, chat completions, models, health, metrics.

Contract: handlers are small async functions over one `EngineWorker`; requests from all clients
are batched together by the engine. Every client mistake (malformed JSON, wrong types, unknown
model, prompt over the context window, absurd max_tokens, n > 1) is answered with an OpenAI-style
JSON error and a 4xx status, mapped in one place (`_errors` middleware, which also maps every other
`SpecdError` to its kind's status); a 500 is only ever an
engine fault, and it carries a message, not a traceback. `stream: true` sends server-sent events
(`data: {chunk}` lines, then `data: [DONE]`); with `stream_options: {"include_usage": true}` the
last chunk before `[DONE]` carries the token counts, as OpenAI's does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from specd.engine.request import SamplingParams, Sequence
from specd.engine.worker import EngineWorker, Submission
from specd.errors import BadRequest, RequestRefused, SpecdError
from specd.model.target import LoadedTarget
from specd.server.metrics import ServingMetrics

MAX_TOKENS_CAP = 32_768


class ApiError(BadRequest):
    """An error answer with its own status and OpenAI's param, code and type fields (and headers)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.http_status, self.param, self.code, self.kind = status, param, code, kind
        self.headers = headers


def _check_capacity(state: ApiState) -> None:
    """Overload gets a clear answer: beyond `max_queued` waiting requests, a 429 with Retry-After."""
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
        return web.json_response(body, status=error.status)


# ---- request parsing --------------------------------------------------------------------------
async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"'{name}' must be of type {expected}, got {type(value).__name__}", param=name)
    return value


def _include_usage(body: dict[str, Any]) -> bool:
    """OpenAI's `stream_options: {"include_usage": true}`: a last chunk with the token counts."""
    options = _field(body, "stream_options", (dict,), {})
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise ApiError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    return include


def _sampling(body: dict[str, Any], default_max_tokens: int) -> tuple[SamplingParams, list[str], bool]:
    if _field(body, "n", (int,), 1) != 1:
        raise ApiError(400, "only n = 1 is supported", param="n")
    for name in ("logprobs", "top_logprobs"):  # refused rather than silently ignored
        if body.get(name) not in (None, False, 0):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
    max_tokens = _field(body, "max_tokens", (int,), None)
    if max_tokens is None:
        max_tokens = _field(body, "max_completion_tokens", (int,), default_max_tokens)
    if not 1 <= max_tokens <= MAX_TOKENS_CAP:
        raise ApiError(400, f"'max_tokens' must be between 1 and {MAX_TOKENS_CAP}, got {max_tokens}",
                       param="max_tokens")
    stop = _field(body, "stop", (str, list), [])
    stops = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    try:
        params = SamplingParams(temperature=float(_field(body, "temperature", (int, float), 1.0)),
                                top_p=float(_field(body, "top_p", (int, float), 1.0)), max_tokens=max_tokens,
                                seed=_field(body, "seed", (int,), None))
    except RequestRefused as error:
        raise ApiError(400, str(error)) from None
    return params, stops, bool(_field(body, "stream", (bool,), False))


def _check_model(state: ApiState, body: dict[str, Any]) -> None:
    model = _field(body, "model", (str,), state.model_name)
    if model != state.model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


# ---- decoding ---------------------------------------------------------------------------------
class _Stream:
    """Tokens from the engine thread to one request's coroutine, cut at stop strings."""

    def __init__(self, state: ApiState, prompt_ids: list[int], params: SamplingParams, stops: list[str],
                 domain: str | None) -> None:
        self.state, self.stops = state, stops
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.request_id = f"specd-{uuid.uuid4().hex[:16]}"
        self.ids: list[int] = []
        self.text_sent = ""
        self.finish_reason: str | None = None
        self.seq: Sequence | None = None

        def put(kind: str) -> Callable[[Any], None]:
            def hand_over(value: Any) -> None:
                self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
            return hand_over

        state.worker.submit(Submission(prompt_ids, params, put("tokens"), put("done"), put("error"),
                                       domain=domain, request_id=self.request_id))

    async def deltas(self):
        """Yield text pieces as they are decoded; sets finish_reason at the end."""
        last = time.perf_counter()
        while True:
            kind, value = await self.events.get()
            if kind == "error":
                status, message = value
                raise ApiError(status, message, kind="invalid_request_error" if status < 500 else "server_error")
            if kind == "tokens":
                now = time.perf_counter()
                self.state.metrics.inter_token_latency.observe((now - last) / max(len(value), 1))
                last = now
                self.ids.extend(value)
            else:
                self.seq = value
                self.ids = list(value.output_ids)
            text = self.state.loaded.decode(self.ids)
            cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                self.state.worker.cancel(self.request_id)
                self.finish_reason = "stop"
                yield text[len(self.text_sent):cut]
                return
            # hold back a possible partial stop string and an incomplete UTF-8 character
            hold = max((len(s) - 1 for s in self.stops), default=0)
            ready = text[:len(text) - hold] if kind == "tokens" else text
            ready = ready.rstrip("\ufffd") if kind == "tokens" else ready
            if len(ready) > len(self.text_sent):
                piece, self.text_sent = ready[len(self.text_sent):], ready
                yield piece
            if kind == "done":
                self.finish_reason = "length" if value.finish_reason == "length" else "stop"
                return


def _domain(state: ApiState, request: web.Request, body: dict[str, Any]) -> str | None:
    """The traffic domain a client labels its request with: OpenAI `metadata.domain` or X-Specd-Domain.

    Labels become metric labels and report keys, so their number is bounded: after MAX_DOMAINS
    distinct ones, any new label is counted as OTHER_DOMAIN."""
    metadata = body.get("metadata")
    domain = metadata.get("domain") if isinstance(metadata, dict) else None
    domain = domain or request.headers.get("X-Specd-Domain")
    if not domain:
        return None
    label = str(domain)[:64]
    if label not in state.domains:
        if len(state.domains) >= MAX_DOMAINS:
            return OTHER_DOMAIN
        state.domains.add(label)
    return label


async def _respond(request: web.Request, body: dict[str, Any], state: ApiState, prompt_ids: list[int],
                   params: SamplingParams, stops: list[str], stream: bool, chat: bool) -> web.StreamResponse:
    include_usage = stream and _include_usage(body)
    _check_capacity(state)
    begin = time.perf_counter()
    decoder = _Stream(state, prompt_ids, params, stops, _domain(state, request, body))
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

    if not stream:
        text = "".join([piece async for piece in decoder.deltas()])
        state.metrics.request_latency.observe(time.perf_counter() - begin)
        return web.json_response({**base, "object": kind, "choices": [choice(text, decoder.finish_reason, False)],
                                  "usage": usage()})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"
    pieces = decoder.deltas()
    try:
        first = await pieces.__anext__()  # errors before the first token still get a JSON error
    except StopAsyncIteration:
        first = ""
    await response.prepare(request)

    async def send(payload: dict[str, Any] | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

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
    except (ConnectionResetError, asyncio.CancelledError):
        state.worker.cancel(decoder.request_id)  # the client went away: free its batch slot
        raise
    state.metrics.request_latency.observe(time.perf_counter() - begin)
    return response


# ---- handlers ---------------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _json_body(request)
    _check_model(state, body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt_ids = list(prompt)
    elif isinstance(prompt, str):
        prompt_ids = state.loaded.encode(prompt)
    else:
        raise ApiError(400, "'prompt' must be a string, a list with one string, or a list of token ids",
                       param="prompt")
    params, stops, stream = _sampling(body, default_max_tokens=16)
    return await _respond(request, body, state, prompt_ids, params, stops, stream, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _json_body(request)
    _check_model(state, body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    texts = [{"role": m["role"], "content": _text_content(m.get("content"))} for m in messages]
    try:
        prompt_ids = state.loaded.encode_messages(texts)
    except Exception as error:  # a chat template can reject role orders it does not know
        raise ApiError(400, f"the chat template refused these messages: {error}", param="messages") from None
    params, stops, stream = _sampling(body, default_max_tokens=256)
    return await _respond(request, body, state, prompt_ids, params, stops, stream, chat=True)


def _text_content(content: Any) -> str:
    """A message's content as text: a string, or OpenAI's list of parts, of which text parts only."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        kinds = {part.get("type") for part in content}
        if kinds <= {"text"} and all(isinstance(part.get("text"), str) for part in content):
            return "".join(part["text"] for part in content)
        raise ApiError(400, f"only text content parts are supported, got {sorted(map(str, kinds - {'text'}))}",
                       param="messages")
    raise ApiError(400, "a message's 'content' must be a string or a list of {type: text, text} parts",
                   param="messages")


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
    """As vLLM's `--api-key`: the OpenAI routes answer only requests that carry the key."""
    key = request.app[STATE].api_key
    if key is not None and request.path in OPENAI_ROUTES:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>", code="invalid_api_key",
                           kind="authentication_error")
    return await handler(request)


def create_app(state: ApiState) -> web.Application:
    app = web.Application(middlewares=[_errors, _api_key], client_max_size=8 * 1024 * 1024)
    app[STATE] = state
    app.router.add_post(OPENAI_ROUTES[0], completions)
    app.router.add_post(OPENAI_ROUTES[1], chat_completions)
    app.router.add_get(OPENAI_ROUTES[2], models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
