"""The OpenAI-compatible API on a tiny model with a byte tokenizer: shapes, streaming, errors."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from specd.drafter.factory import DrafterSpec
from specd.server.serve import ServeOptions, build_server
from specd.testing import tiny_loaded_target

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def client(tmp_path):
    loaded = tiny_loaded_target()
    app = build_server(ServeOptions(store=str(tmp_path / "store"), learner=False, model_name="tiny",
                                    drafter=DrafterSpec(head_vocab=200), report_seconds=0.1), loaded)
    async with TestClient(TestServer(app)) as client:
        yield client


async def test_completion_has_openai_shape_and_is_greedy_deterministic(client) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0}
    first = await (await client.post("/v1/completions", json=body)).json()
    second = await (await client.post("/v1/completions", json=body)).json()
    assert first["object"] == "text_completion" and first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["usage"]["prompt_tokens"] == 5 and first["usage"]["completion_tokens"] <= 12
    assert first["choices"][0]["finish_reason"] in ("stop", "length")


async def test_chat_completion_stream_sends_events_and_done(client) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
            "temperature": 0, "stream": True}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.headers["Content-Type"].startswith("text/event-stream")
    lines = [line for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    plain = await (await client.post("/v1/chat/completions", json={**body, "stream": False})).json()
    assert streamed == plain["choices"][0]["message"]["content"]


async def test_stop_string_cuts_the_text(client) -> None:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 40, "temperature": 0}
    full = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]["text"]
    if len(full) < 4:
        pytest.skip("the tiny model stopped too early to place a stop string")
    stop = full[2:4]
    cut = await (await client.post("/v1/completions", json={**body, "stop": stop})).json()
    assert cut["choices"][0]["text"] == full[:full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ({"model": "tiny", "prompt": 5}, 400, "'prompt'"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -2}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "n": 3}, 400, "n = 1"),
    ({"model": "tiny", "prompt": "x" * 600, "max_tokens": 10}, 400, "context window"),
    ({"model": "tiny", "prompt": [1, 2, 99999]}, 400, "vocabulary"),
])
async def test_bad_requests_get_openai_style_4xx(client, body, status, needle) -> None:
    response = await client.post("/v1/completions", json=body)
    assert response.status == status
    error = (await response.json())["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


async def test_malformed_json_and_unknown_route_are_json_errors(client) -> None:
    response = await client.post("/v1/chat/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    assert response.status == 400 and "not valid JSON" in (await response.json())["error"]["message"]
    assert (await client.get("/v1/nothing")).status == 404
    bad_messages = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": 1}]})
    assert bad_messages.status == 400


async def test_models_health_and_metrics(client) -> None:
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny"
    health = await (await client.get("/health")).json()
    assert health["status"] == "ok"
    await client.post("/v1/completions", json={"model": "tiny", "prompt": "hey", "max_tokens": 8, "temperature": 0})
    text = await (await client.get("/metrics")).text()
    for name in ("specd_spec_decode_num_draft_tokens_total", "specd_spec_decode_num_verification_passes_total",
                 "specd_spec_decode_accept_length", "specd_request_latency_seconds_bucket",
                 "specd_records_published_total", "specd_drafter_swaps_total"):
        assert name in text, name


async def test_acceptance_series_is_labelled_by_domain(client) -> None:
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    await client.post("/v1/completions", json={**body, "metadata": {"domain": "code"}})
    await client.post("/v1/completions", json=body, headers={"X-Specd-Domain": "chat"})
    for _ in range(50):
        series = (await (await client.get("/v1/acceptance")).json())["series"]
        if {"code", "chat"} <= {point["domain"] for point in series}:
            break
        await asyncio.sleep(0.1)
    assert {"code", "chat"} <= {point["domain"] for point in series}
