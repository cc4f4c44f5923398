"""A server that stops (SIGTERM, Ctrl+C) with requests in flight: each gets its grace to finish,
then an answer that says why it ended (a JSON 503, or an error event and [DONE] in its stream),
and the server is gone within the grace and a few seconds, not aiohttp's minute per connection."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web
from test_api import eventually
from test_streaming import build_app, events, slow_steps

from specd.serving.http.api import SHUTTING_DOWN, STATE, _check_capacity
from specd.serving.http.fields import ApiError

pytestmark = pytest.mark.asyncio


async def test_requests_still_in_flight_after_the_grace_end_with_a_503_that_says_why(tmp_path, monkeypatch) -> None:
    app = build_app(tmp_path)
    state = app[STATE]
    state.shutdown_grace_s = 1.0
    slow_steps(app, monkeypatch, 0.02)  # 480 tokens take seconds; 3 tokens finish inside the grace
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}/v1/completions"
    async with aiohttp.ClientSession() as session:
        long_body = {"model": "tiny", "prompt": "abc", "max_tokens": 480, "temperature": 0}
        streamed = asyncio.create_task(session.post(url, json={**long_body, "stream": True}))
        plain = asyncio.create_task(session.post(url, json=long_body))

        async def both_decoding() -> bool:
            return len(state.worker.engine.running) == 2
        await eventually(both_decoding)
        short = asyncio.create_task(session.post(url, json={**long_body, "max_tokens": 3}))
        await eventually(lambda: asyncio.sleep(0, result=len(state.streams) == 3))
        began = time.monotonic()
        stopping = asyncio.create_task(runner.cleanup())
        stream_events = events(await (await streamed).text())
        plain_answer = await plain
        short_answer = await short
        assert short_answer.status == 200 and (await short_answer.json())["usage"]["completion_tokens"] == 3
        assert plain_answer.status == 503
        assert (await plain_answer.json())["error"]["message"] == SHUTTING_DOWN
        assert stream_events[-1]["error"]["message"] == SHUTTING_DOWN and len(stream_events) > 1
        await stopping
    assert 1.0 <= time.monotonic() - began < 6.0
    assert not state.streams  # every handler let its request go
    with pytest.raises(ApiError) as refused:  # a request that reaches a draining server is turned away
        _check_capacity(state)
    assert refused.value.http_status == 503 and refused.value.headers == {"Retry-After": "1"}
