"""Streamed text and what one client's connection does to the others.

The detokeniser and stop strings on their own (pieces concatenate to the whole text; work per
token bounded), then through the API on the tiny model with the byte tokenizer, whose random
outputs are full of multi-byte and invalid UTF-8: streamed deltas equal the non-streamed text; a
client that disconnects (streaming or not, decoding or queued) has its request cancelled within
a step or two while a concurrent request is unaffected; a huge prompt is parsed and tokenised off
the event loop, so another client's stream keeps flowing; a body over the limit gets a 413.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from test_api import EndlessByteTokenizer, eventually, target_only_text

from specd.drafter.factory import DrafterSpec
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, Sequence
from specd.serving.http.api import MAX_BODY_BYTES, STATE
from specd.serving.http.detokenize import IncrementalDetokenizer, StopStrings
from specd.serving.serve import ServeOptions, build_server
from specd.testing import ByteTokenizer, tiny_loaded_target

BYTES = ByteTokenizer()
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None)


def detokenize(ids: list[int], chunks: list[int], decode=BYTES.decode, max_pending: int = 8) -> list[str]:
    """The pieces an IncrementalDetokenizer emits for ids pushed in chunks of the given sizes."""
    detokenizer, pieces, start = IncrementalDetokenizer(decode, max_pending), [], 0
    for size in chunks:
        pieces.append(detokenizer.push(ids[start:start + size]))
        start += size
    pieces.append(detokenizer.push(ids[start:]))
    pieces.append(detokenizer.finish())
    return pieces


# ---- the detokeniser and stop strings on their own -------------------------------------------
@FUZZ
@given(ids=st.lists(st.integers(0, ByteTokenizer.vocab_size - 1), max_size=80),
       chunks=st.lists(st.integers(1, 5), max_size=40), max_pending=st.integers(4, 10))
def test_deltas_concatenate_to_the_whole_decode_for_any_ids(ids, chunks, max_pending) -> None:
    # any bytes at all (invalid UTF-8, characters split across chunks, skipped special tokens)
    assert "".join(detokenize(ids, chunks, max_pending=max_pending)) == BYTES.decode(ids)


@FUZZ
@given(text=st.text(max_size=60), chunks=st.lists(st.integers(1, 5), max_size=40))
def test_no_delta_holds_half_a_character(text, chunks) -> None:
    pieces = detokenize(BYTES.encode(text), chunks)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces) or "\ufffd" in text


class CountingTokenizer(EndlessByteTokenizer):
    """Counts the tokens each decode call reads: the detokeniser's work."""

    def __init__(self) -> None:
        self.decoded: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded.append(len(ids))
        return super().decode(ids, skip_special_tokens)


@pytest.mark.parametrize("text", ["plain ascii text, " * 200, "héllo wörld € 😀 ", bytes(range(128, 256)) * 20],
                         ids=["ascii", "multibyte", "invalid"])
def test_work_per_token_is_bounded_whatever_the_output_length(text) -> None:
    ids = list(text.encode()) if isinstance(text, str) else list(text)
    ids = (ids * (3000 // len(ids) + 1))[:3000]
    counter = CountingTokenizer()
    pieces = detokenize(ids, [1, 2, 3, 4, 5] * 600, decode=counter.decode)
    assert "".join(pieces) == BYTES.decode(ids)
    # a window is at most the last piece, the held tokens and one push: independent of the 3000 tokens
    assert max(counter.decoded) <= 2 * (8 + 5)
    assert sum(counter.decoded) <= 60 * len(ids)


@FUZZ
@given(text=st.text("ab\n€", max_size=40), stops=st.lists(st.text("ab\n€", min_size=1, max_size=4), max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_stop_strings_cut_where_a_search_of_the_whole_text_would(text, stops, cuts) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    cutter = StopStrings(stops)
    out = "".join(cutter.feed(piece) for piece in pieces) + cutter.finish()
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    assert out == (text[:first] if first >= 0 else text)
    assert cutter.is_stopped == (first >= 0)


@pytest.fixture(scope="module")
def smollm2_decode():
    from transformers import AutoTokenizer

    from specd.model.bundled import bundled_target_dir

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_target_dir()))
    return tokenizer, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(text=st.text(max_size=60), ids=st.lists(st.integers(0, 49_151), max_size=40),
       chunks=st.lists(st.integers(1, 5), max_size=20))
def test_deltas_concatenate_to_the_whole_decode_with_smollm2s_tokenizer(smollm2_decode, text, ids, chunks) -> None:
    # a real byte-level BPE: its tokens cut characters apart, its decode joins them
    tokenizer, decode = smollm2_decode
    for sequence in (tokenizer.encode(text, add_special_tokens=False), ids):
        assert "".join(detokenize(sequence, chunks, decode=decode)) == decode(sequence)


# ---- through the API -------------------------------------------------------------------------
def build_app(tmp_path, tokenizer: ByteTokenizer | None = None, max_batch: int = 8) -> web.Application:
    loaded = replace(tiny_loaded_target(), tokenizer=tokenizer or EndlessByteTokenizer())
    return build_server(ServeOptions(store=str(tmp_path / "store"), learner=False, model_name="tiny",
                                     max_batch=max_batch, drafter=DrafterSpec(head_vocab=200),
                                     report_seconds=0.1), loaded)


@contextlib.asynccontextmanager
async def serving(app: web.Application, handler_cancellation: bool = False) -> AsyncIterator[tuple[Any, str]]:
    """The app on a loopback port as `specd serve` runs it (web.run_app does not cancel handlers
    when a client disconnects; aiohttp's TestServer does), and a client session."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with aiohttp.ClientSession() as session:
            yield session, f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def alone(app: web.Application, prompt: str, max_tokens: int) -> str:
    """What the target alone decodes greedily for this prompt (the API must say exactly this)."""
    loaded = app[STATE].loaded
    engine = Engine(loaded.model, None, EngineConfig())
    return loaded.decode(engine.generate([loaded.encode(prompt)], SamplingParams(max_tokens=max_tokens))[0].output_ids)


def slow_steps(app: web.Application, monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[list[str]]:
    """Make every engine step last `seconds` longer; returns the running request ids after each step."""
    engine = app[STATE].worker.engine
    step, log = engine.step, []

    def slow() -> list[Sequence]:
        time.sleep(seconds)
        finished = step()
        log.append([seq.request_id for seq in engine.running])
        return finished

    monkeypatch.setattr(engine, "step", slow)
    return log


@pytest_asyncio.fixture
async def client(tmp_path):
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(build_app(tmp_path))) as test_client:
        yield test_client


def events(body: str) -> list[Any]:
    lines = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.asyncio
@pytest.mark.parametrize("stop", [None, "e", ["ab", "\n", "xyz"]])
async def test_streamed_deltas_concatenate_to_the_non_streamed_text(client, stop) -> None:
    for i, prompt in enumerate(["hello", "def f(x):", "€uro", "\u00e9t\u00e9 ", "zz"]):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 40 + 7 * i, "temperature": 0, "stop": stop}
        plain = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
        chunks = events(await (await client.post("/v1/completions", json={**body, "stream": True})).text())
        assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == plain["finish_reason"]
        if stop is None:  # and both are what the target alone decodes, every byte of it
            assert plain["text"] == target_only_text(client, prompt, 40 + 7 * i)


@pytest.mark.asyncio
async def test_a_long_stream_decodes_a_bounded_window_per_token(tmp_path) -> None:
    counter = CountingTokenizer()
    app = build_app(tmp_path, tokenizer=counter)
    async with serving(app) as (session, url):
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 500, "temperature": 0, "stream": True}
        counter.decoded.clear()
        chunks = events(await (await session.post(f"{url}/v1/completions", json=body)).text())
    assert len(chunks) > 20
    assert max(counter.decoded) <= 2 * (8 + 5)  # held tokens plus one step's k + 1, not the 500 tokens
    assert sum(counter.decoded) <= 60 * 500


async def retired(worker: Any, seq_of: dict[str, Sequence], request_id: str) -> Sequence:
    """The request once it has ended and its slot is free (the worker has let it go)."""
    async def let_go() -> bool:
        return seq_of[request_id].is_finished and request_id not in worker._active
    await eventually(let_go, timeout=20)
    return seq_of[request_id]


def recording_admissions(app: web.Application, monkeypatch: pytest.MonkeyPatch) -> dict[str, Sequence]:
    engine = app[STATE].worker.engine
    seen: dict[str, Sequence] = {}
    add_request = engine.add_request

    def recording(*args, **kwargs) -> Sequence:
        seq = add_request(*args, **kwargs)
        seen[seq.request_id] = seq
        return seq

    monkeypatch.setattr(engine, "add_request", recording)
    return seen


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("handler_cancellation", [False, True], ids=["run_app", "cancelling"])
async def test_a_client_that_disconnects_frees_its_slot_within_a_step(tmp_path, monkeypatch, stream,
                                                                       handler_cancellation) -> None:
    app = build_app(tmp_path)
    running_after_step = slow_steps(app, monkeypatch, 0.02)  # the long request is mid-decoding when its client leaves
    seq_of = recording_admissions(app, monkeypatch)
    worker = app[STATE].worker
    async with serving(app, handler_cancellation) as (session, url):
        neighbour_body = {"model": "tiny", "prompt": "neighbour", "max_tokens": 60, "temperature": 0}
        neighbour = asyncio.create_task(session.post(f"{url}/v1/completions", json=neighbour_body))
        long_body = {"model": "tiny", "prompt": "abc", "max_tokens": 480, "temperature": 0, "stream": stream}
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(f"{url}/v1/completions", json=long_body,
                                    timeout=aiohttp.ClientTimeout(total=0.6)) as response:
                await response.read()
        steps_at_close = len(running_after_step)
        (long_id,) = [rid for rid, seq in seq_of.items() if seq.params.max_tokens == 480]
        seq = await retired(worker, seq_of, long_id)
        assert seq.finish_reason == "cancelled" and 0 < seq.num_output_tokens < 480
        # steps that still decoded it after its client left: the one in flight, the one that began before
        # the cancellation reached the engine thread, and one of slack for a busy machine (not 480 tokens' worth)
        assert sum(long_id in running for running in running_after_step[steps_at_close:]) <= 3
        answer = await (await neighbour).json()
        assert answer["choices"][0]["text"] == alone(app, "neighbour", 60)


@pytest.mark.asyncio
async def test_a_queued_request_whose_client_leaves_leaves_the_line(tmp_path, monkeypatch) -> None:
    app = build_app(tmp_path, max_batch=1)
    slow_steps(app, monkeypatch, 0.02)
    worker = app[STATE].worker
    async with serving(app) as (session, url):
        first_body = {"model": "tiny", "prompt": "first", "max_tokens": 40, "temperature": 0}
        first = asyncio.create_task(session.post(f"{url}/v1/completions", json=first_body))

        async def first_decoding() -> bool:
            return len(worker.engine.running) == 1
        await eventually(first_decoding)
        with pytest.raises(asyncio.TimeoutError):  # the one slot is taken: this one waits in line, then leaves
            await session.post(f"{url}/v1/completions", json={**first_body, "prompt": "second"},
                               timeout=aiohttp.ClientTimeout(total=0.3))

        async def line_empty() -> bool:
            return worker.queued == 0
        await eventually(line_empty, timeout=2)
        assert worker.engine.running and worker.engine.running[0].prompt_ids == list(b"first")
        answer = await (await first).json()
        assert answer["choices"][0]["text"] == alone(app, "first", 40)


class SlowTokenizer(EndlessByteTokenizer):
    """Tokenising a long prompt takes a second (sleeping, as a tokenizer that releases the GIL would)."""

    def __init__(self) -> None:
        self.busy: list[float] = []  # start and end of the slow tokenisation

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > 100_000:
            self.busy.append(time.perf_counter())
            time.sleep(1.0)
            self.busy.append(time.perf_counter())
        return super().encode(text, add_special_tokens)


@pytest.mark.asyncio
async def test_a_huge_prompt_is_tokenised_off_the_loop_while_another_stream_flows(tmp_path, monkeypatch) -> None:
    tokenizer = SlowTokenizer()
    app = build_app(tmp_path, tokenizer=tokenizer)
    slow_steps(app, monkeypatch, 0.01)
    arrivals: list[float] = []
    async with serving(app) as (session, url):
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 480, "temperature": 0, "stream": True}
        async with session.post(f"{url}/v1/completions", json=body) as stream:
            huge: asyncio.Task | None = None
            async for _ in stream.content:
                arrivals.append(time.perf_counter())
                if huge is None:  # the stream flows: now a 3 MB prompt arrives
                    huge = asyncio.create_task(session.post(f"{url}/v1/completions",
                                                            json={"model": "tiny", "prompt": "x" * 3_000_000}))
                elif huge.done():
                    break  # leaving early cancels the stream (the test above)
        assert huge is not None
        refused = await huge
        assert refused.status == 400 and "context window" in (await refused.json())["error"]["message"]
    begin, end = tokenizer.busy
    during = [t for t in arrivals if begin <= t <= end]
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if begin <= b and a <= end]
    assert len(during) >= 5 and max(gaps) < 0.5  # on the loop, tokenising would have stalled it a second


@pytest.mark.asyncio
async def test_a_body_over_the_limit_gets_413_in_openai_shape(client) -> None:
    body = json.dumps({"model": "tiny", "prompt": "x" * (MAX_BODY_BYTES + 1024)})
    response = await client.post("/v1/completions", data=body, headers={"Content-Type": "application/json"})
    assert response.status == 413
    error = (await response.json())["error"]
    assert error["code"] == "request_too_large" and str(MAX_BODY_BYTES) in error["message"]
