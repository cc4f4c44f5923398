"""Property-based fuzzing of the OpenAI routes: whatever a client sends, the server answers in shape
and no other client notices.

Hypothesis draws request bodies for /v1/completions and /v1/chat/completions over every field the
API reads (and junk in each: wrong JSON types, huge, negative and non-finite numbers, lone
surrogates, odd roles and content parts, unknown fields), plus bodies that are not a JSON object
at all. Each answer must be a 2xx in OpenAI's shape or a 4xx with OpenAI's error JSON, never a
5xx. Meanwhile fixed greedy requests run concurrently, streaming and not, and each must get
exactly what the target alone decodes: one bad request never hurts another. The server runs on
its own event loop thread as `specd serve` runs it, on the tiny model with the byte tokenizer.
Examples are derandomised and capped, so the run is the same on every machine.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specd.drafter.factory import DrafterSpec
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.serving.http.api import STATE
from specd.serving.serve import ServeOptions, build_server
from specd.testing import tiny_loaded_target

T = TypeVar("T")
ROUTES = ("/v1/completions", "/v1/chat/completions")

# ---- strategies -------------------------------------------------------------------------------
junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
huge = st.sampled_from([2**63, 2**64, -(2**63) - 1, 2**80, 10**30, 10**400, -(10**400), 1e308, -1e308, 5e-324])
numbers = st.integers(-3, 40) | st.floats() | huge | st.sampled_from(["NaN", "1.0", "inf", "", "0"])
texts = st.text(max_size=30) | st.sampled_from(["\ud800", "a\udfffb", "é€😀", "\x00", " " * 40])


content_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio"]) | junk},
    optional={"text": texts | junk, "image_url": junk}) | junk
odd_message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "system", "assistant", "tool", "developer", ""]) | texts | junk,
    "content": texts | st.lists(content_part, max_size=3) | junk,
    "name": junk}) | junk
valid_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=30)  # no lone surrogates
valid_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]),
    "content": valid_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": valid_text}),
                                     min_size=1, max_size=3)})

# each field: what a client may send, and what it may send by mistake (or malice)
FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "model": (st.just("tiny"), texts | junk),
    "max_tokens": (st.integers(1, 24), numbers | junk),
    "max_completion_tokens": (st.integers(1, 24), numbers | junk),
    "temperature": (st.just(0) | st.floats(0, 2), numbers | junk),
    "top_p": (st.floats(0.01, 1), numbers | junk),
    "seed": (st.integers(-(2**63), 2**64 - 1), st.integers(-(2**65), 2**65) | huge | junk),
    "stop": (valid_text.filter(bool) | st.lists(valid_text.filter(bool), max_size=4), texts | st.lists(texts) | junk),
    "stream": (st.booleans(), junk),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "n": (st.just(1), st.integers(-1, 3) | junk),
    "logprobs": (st.just(False), st.booleans() | st.integers(0, 5) | junk),
    "top_logprobs": (st.just(0), st.integers(0, 5) | junk),
    "echo": (st.just(False), st.booleans() | junk),
    "presence_penalty": (st.sampled_from([0, 0.0]), numbers | junk),
    "tool_choice": (st.sampled_from(["none", "auto"]), texts | junk),
    "response_format": (st.just({"type": "text"}), junk),
    "user": (valid_text, junk),
    "metadata": (st.fixed_dictionaries({"domain": valid_text}), st.fixed_dictionaries({"domain": texts | junk}) | junk),
}
PROMPT = (valid_text | st.lists(valid_text, min_size=1, max_size=1)
          | st.lists(st.integers(0, 257), min_size=1, max_size=20),
          texts | st.lists(texts, max_size=3) | st.lists(st.integers(-5, 300), max_size=20)
          | st.lists(st.lists(st.integers(0, 255), max_size=3), max_size=2) | st.lists(huge, max_size=2) | junk)
MESSAGES = (st.lists(valid_message, min_size=1, max_size=3), st.lists(odd_message, max_size=3) | junk)


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": 4, **fields}).encode()


# bodies that once failed the server (or nearly): each must get a 4xx, or a 200 for a fine one
EDGES = [
    b"[" * 5000, b'{"max_tokens": ' + b"9" * 5000 + b"}", b"", b"null", b'{"prompt": "x"} trailing',
    b'{"temperature": NaN, "prompt": "x"}', b'{"top_p": -Infinity, "prompt": "x"}', b'{"prompt": "\xff\xfe"}',
    '{"prompt": "\u00e9", "max_tokens": 3}'.encode("utf-16"),
    _body(prompt="x", temperature=10**400), _body(prompt="x", top_p=-(10**400)), _body(prompt="x", seed=2**80),
    _body(prompt="\ud800"), _body(messages=[{"role": "user", "content": "a\udfffb"}]),
    _body(messages=[{"role": "\ud800", "content": "x"}]), _body(prompt="x", stop=["\ud800"]),
    _body(messages=[{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]),
    _body(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    _body(prompt="x", metadata={"domain": "\udfff"}), _body(prompt="x", metadata={"domain": ["code"]}),
    _body(prompt="x", temperature=1e-40), _body(prompt="x", top_p=1e-50), _body(prompt=[10**30]),
    _body(prompt="x", max_tokens=10**30), _body(prompt="x" * 600),
]


class Request(tuple[str, bytes]):
    """A route and a body, shown shortened when hypothesis reports a failing one."""

    def __repr__(self) -> str:
        route, body = self
        return f"Request({route!r}, {body[:300]!r}{'...' if len(body) > 300 else ''} ({len(body)} bytes))"


def edge_request(body: bytes, route: str = ROUTES[0]) -> Request:
    """An edge body to the route that reads its main field."""
    return Request((ROUTES[1] if b'"messages"' in body else ROUTES[0] if b'"prompt"' in body else route, body))


@st.composite
def requests(draw: st.DrawFn) -> Request:
    """A route and a body: mostly JSON objects over the API's fields with a few of them wrong,
    sometimes anything else."""
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["fields"] * 8 + ["json", "bytes", "edge"]))
    if kind == "json":  # valid JSON that is not an object, or an object of junk
        return Request((route, json.dumps(draw(junk)).encode()))
    if kind == "bytes":
        return Request((route, draw(st.binary(max_size=40))))
    if kind == "edge":
        return edge_request(draw(st.sampled_from(EDGES)), route)
    fields = {"prompt": PROMPT} if route == ROUTES[0] else {"messages": MESSAGES}
    fields.update(FIELDS)
    wrong = draw(st.sets(st.sampled_from(sorted(fields)), max_size=2))
    body = {}
    for name, (valid, odd) in fields.items():
        if name in wrong or draw(st.booleans()):
            body[name] = draw(odd if name in wrong else valid)
    body.update(draw(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in fields), junk, max_size=2)))
    return Request((route, json.dumps(body).encode()))


# ---- the server on its own loop ---------------------------------------------------------------
class LiveServer:
    """The app on a loopback port, served by an event loop on its own thread, as `specd serve` does."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-server-loop", daemon=True)
        self.thread.start()
        self.url, self.session = self.call(self._start())

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _start(self) -> tuple[str, aiohttp.ClientSession]:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}", aiohttp.ClientSession()

    async def post(self, route: str, body: bytes) -> tuple[int, str, bytes]:
        async with self.session.post(self.url + route, data=body,
                                     headers={"Content-Type": "application/json"}) as response:
            return response.status, response.headers.get("Content-Type", ""), await response.read()

    async def get(self, route: str) -> int:
        async with self.session.get(self.url + route) as response:
            await response.read()
            return response.status

    async def _stop(self) -> None:
        await self.session.close()
        await self.runner.cleanup()

    def close(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def server(tmp_path):
    loaded = tiny_loaded_target()  # the byte tokenizer with its EOS: answers end by length, EOS or stop
    app = build_server(ServeOptions(store=str(tmp_path / "store"), learner=False, model_name="tiny",
                                    drafter=DrafterSpec(head_vocab=200), report_seconds=0.1), loaded)
    live = LiveServer(app)
    yield live
    live.close()


# ---- what every answer must be ----------------------------------------------------------------
def check_answer(route: str, status: int, content_type: str, raw: bytes) -> None:
    assert status < 500, raw[:500]
    if status != 200:
        assert 400 <= status < 500 and content_type.startswith("application/json"), (status, raw[:500])
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and "param" in error and "code" in error
        return
    chat = route == ROUTES[1]
    if content_type.startswith("text/event-stream"):
        lines = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        assert all("error" not in chunk for chunk in chunks)  # an error event means an engine fault
        kind = "chat.completion.chunk" if chat else "text_completion"
        assert all(chunk["object"] == kind and chunk["model"] == "tiny" for chunk in chunks)
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
        return
    answer = json.loads(raw)
    assert answer["object"] == ("chat.completion" if chat else "text_completion")
    choice = answer["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length")
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] >= 0


# ---- the fixed greedy neighbours --------------------------------------------------------------
NEIGHBOURS = [("/v1/completions", {"prompt": "hello", "max_tokens": 20}),
              ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 28, "stream": True}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24})]


def neighbour_text(route: str, raw: bytes, stream: bool) -> str:
    if stream:
        chunks = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    choice = json.loads(raw)["choices"][0]
    return choice["message"]["content"] if route == ROUTES[1] else choice["text"]


def alone(app: web.Application, route: str, body: dict[str, Any]) -> str:
    """What the target alone decodes greedily for this request."""
    loaded = app[STATE].loaded
    prompt = loaded.encode_messages(body["messages"]) if route == ROUTES[1] else loaded.encode(body["prompt"])
    engine = Engine(loaded.model, None, EngineConfig(eos_token_ids=loaded.eos_token_ids))
    return loaded.decode(engine.generate([prompt], SamplingParams(max_tokens=body["max_tokens"]))[0].output_ids)


async def keep_neighbours_busy(live: LiveServer, stop: asyncio.Event, answers: list[tuple[int, int, bytes]]) -> None:
    """Send the greedy neighbours again and again, all at once, until told to stop."""
    while not stop.is_set():
        sent = [live.post(route, json.dumps({"model": "tiny", "temperature": 0, **body}).encode())
                for route, body in NEIGHBOURS]
        for i, (status, _, raw) in enumerate(await asyncio.gather(*sent)):
            answers.append((i, status, raw))


def test_every_known_edge_gets_a_4xx_or_a_well_formed_answer(server: LiveServer) -> None:
    statuses = []
    for route, body in map(edge_request, EDGES):
        status, content_type, raw = server.call(server.post(route, body))
        check_answer(route, status, content_type, raw)
        statuses.append(status)
    assert statuses.count(200) == 4  # the valid ones: a tiny temperature or top_p, an odd domain label, é in UTF-16
    assert server.call(server.get("/metrics")) == 200


def test_no_request_gets_a_5xx_or_changes_a_concurrent_greedy_answer(server: LiveServer) -> None:
    engine = server.app[STATE].worker.engine
    resets: list[int] = []
    reset = engine.reset
    engine.reset = lambda: (resets.append(1), reset())[1]  # type: ignore[method-assign]  # a reset means a faulted step
    stop = asyncio.Event()
    neighbours: list[tuple[int, int, bytes]] = []
    busy = asyncio.run_coroutine_threadsafe(keep_neighbours_busy(server, stop, neighbours), server.loop)
    statuses: Counter[int] = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=requests())
    def fuzz(request: Request) -> None:
        route, body = request
        status, content_type, raw = server.call(server.post(route, body))
        statuses[status] += 1
        check_answer(route, status, content_type, raw)

    try:
        fuzz()
    finally:
        server.loop.call_soon_threadsafe(stop.set)
        busy.result(timeout=60)
    print(statuses)
    assert statuses[200] >= 15 and sum(statuses[s] for s in statuses if 400 <= s < 500) >= 50, statuses
    assert not resets
    for page in ("/metrics", "/health"):  # client-chosen labels (odd domains among them) still export
        assert server.call(server.get(page)) == 200
    assert len(neighbours) >= 3 * len(NEIGHBOURS)
    expected = [alone(server.app, route, body) for route, body in NEIGHBOURS]
    for i, status, raw in neighbours:
        route, body = NEIGHBOURS[i]
        assert status == 200 and neighbour_text(route, raw, body.get("stream", False)) == expected[i]
