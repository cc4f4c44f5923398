"""The OpenAI-compatible API on a tiny model with a byte tokenizer: shapes, streaming, errors, metrics.

The tokenizer has no EOS token, so every completion runs to its max_tokens (unless a stop string
cuts it): lengths, texts and counts are known before a request is sent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from conftest import counts_by_source
from prometheus_client.parser import text_string_to_metric_families

from specd.drafter.factory import DrafterSpec
from specd.engine.engine import Engine, EngineConfig
from specd.engine.lookahead import LookaheadConfig, LookaheadController
from specd.engine.request import SamplingParams, Sequence
from specd.engine.worker import EngineWorker, Failure, Submission
from specd.serving.http.api import STATE, ApiState
from specd.serving.serve import ServeOptions, build_server
from specd.testing import ByteTokenizer, tiny_loaded_target

pytestmark = pytest.mark.asyncio


class EndlessByteTokenizer(ByteTokenizer):
    """The byte tokenizer without an EOS token: a request stops at max_tokens or a stop string."""

    eos_token_id = None  # type: ignore[assignment]


@pytest_asyncio.fixture
async def client(tmp_path):
    loaded = replace(tiny_loaded_target(), tokenizer=EndlessByteTokenizer())
    app = build_server(ServeOptions(store=str(tmp_path / "store"), learner=False, model_name="tiny",
                                    drafter=DrafterSpec(head_vocab=200), report_seconds=0.1), loaded)
    async with TestClient(TestServer(app)) as client:
        yield client


def api_state(client: TestClient) -> ApiState:
    return client.server.app[STATE]


def target_only_text(client: TestClient, prompt: str, max_tokens: int) -> str:
    """What the target alone decodes greedily for this prompt (the API must say exactly this)."""
    loaded = api_state(client).loaded
    engine = Engine(loaded.model, None, EngineConfig())
    seq = engine.generate([loaded.encode(prompt)], SamplingParams(max_tokens=max_tokens))[0]
    return loaded.decode(seq.output_ids)


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    """Poll an asynchronous condition until it holds; fail after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        assert loop.time() < deadline, "the condition never held"
        await asyncio.sleep(0.05)


async def test_completion_has_openai_shape_and_equals_target_only_greedy(client) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0}
    first = await (await client.post("/v1/completions", json=body)).json()
    second = await (await client.post("/v1/completions", json=body)).json()
    assert first["object"] == "text_completion"
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == target_only_text(client, "hello", 12)
    assert first["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert first["choices"][0]["finish_reason"] == "length"


async def test_a_seeded_sampled_completion_is_the_target_alones_draw_for_that_seed(client) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": 11}
    answer = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]["text"]
    streamed = await client.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in (await streamed.text()).splitlines() if line.startswith("data: {")]
    loaded = api_state(client).loaded
    alone = Engine(loaded.model, None, EngineConfig()).generate(
        [loaded.encode("hello")], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=11))[0]
    assert answer == "".join(c["choices"][0]["text"] for c in chunks) == loaded.decode(alone.output_ids)
    other = (await (await client.post("/v1/completions", json={**body, "seed": 12})).json())["choices"][0]["text"]
    assert other != answer


async def test_chat_completion_stream_sends_events_and_done(client) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
            "temperature": 0, "stream": True}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.headers["Content-Type"].startswith("text/event-stream")
    lines = [line for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    plain = await (await client.post("/v1/chat/completions", json={**body, "stream": False})).json()
    assert streamed == plain["choices"][0]["message"]["content"]


async def test_stream_with_include_usage_ends_with_the_token_counts(client) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 9, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    lines = [line for line in (await (await client.post("/v1/completions", json=body)).text()).splitlines()
             if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
    assert all("usage" not in json.loads(line[6:]) for line in lines[:-2])
    bad = await client.post("/v1/completions", json={**body, "stream_options": {"include_usage": "yes"}})
    assert bad.status == 400 and "include_usage" in (await bad.json())["error"]["message"]


async def test_latency_histograms_hold_time_to_first_token_apart_and_gaps_of_streamed_tokens_only(client) -> None:
    def counts() -> tuple[float, float]:
        metrics = api_state(client).metrics
        first = metrics.time_to_first_token.collect()[0].samples
        gaps = metrics.inter_token_latency.collect()[0].samples
        return (next(x.value for x in first if x.name.endswith("_count")),
                next(x.value for x in gaps if x.name.endswith("_count")))

    body = {"model": "tiny", "prompt": "hello", "max_tokens": 9, "temperature": 0}
    before = counts()
    await (await client.post("/v1/completions", json=body)).json()
    after_plain = counts()
    assert after_plain == (before[0] + 1, before[1])   # an answer sent whole has no gaps between tokens
    await (await client.post("/v1/completions", json={**body, "stream": True})).text()
    # one gap per streamed token after the first, however many tokens a step emitted
    assert counts() == (after_plain[0] + 1, after_plain[1] + 8)


async def test_stop_string_cuts_the_text(client) -> None:
    body = {"model": "tiny", "prompt": "hey", "max_tokens": 40, "temperature": 0}
    full = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]["text"]
    assert full == target_only_text(client, "hey", 40)
    # 40 bytes decode to at least 10 characters (UTF-8 spends at most 4 bytes on one)
    stop = full[4:6]
    cut = await (await client.post("/v1/completions", json={**body, "stop": stop})).json()
    assert cut["choices"][0]["text"] == full[:full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


async def test_a_stop_string_answer_counts_its_own_tokens_and_is_still_recorded(client) -> None:
    from specd.transport.bus import InProcessBus

    state = api_state(client)
    state.worker.bus = bus = InProcessBus()  # the records a learner would get
    loaded = state.loaded
    ids = Engine(loaded.model, None, EngineConfig()).generate([loaded.encode("hey")],
                                                               SamplingParams(max_tokens=40))[0].output_ids
    full = loaded.decode(ids)
    start = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[start:start + 2]
    # the answer's tokens: the fewest of the output whose text holds the stop string
    through_stop = next(n for n in range(1, len(ids) + 1) if stop in loaded.decode(ids[:n]))
    body = {"model": "tiny", "prompt": "hey", "max_tokens": 40, "temperature": 0, "stop": stop}
    answer = await (await client.post("/v1/completions", json=body)).json()
    assert answer["choices"][0]["text"] == full[:full.index(stop)]
    assert answer["usage"]["completion_tokens"] == through_stop  # not the rest of the step that decoded it
    await eventually(lambda: asyncio.sleep(0, result=bus.backlog == 1))
    assert bus.take(1, 0.0)[0]["output_ids"][:through_stop] == ids[:through_stop]  # served traffic: recorded


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ({"model": "tiny", "prompt": 5}, 400, "'prompt'"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 2, "max_completion_tokens": "x"}, 400, "max_completion_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -2}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "temperature": 1.0, "seed": 2**80}, 400, "seed"),
    ({"model": "tiny", "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "echo": True}, 400, "'echo' is not supported"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 100}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"model": "tiny", "prompt": "x", "n": 3}, 400, "n = 1"),
    ({"model": "tiny", "prompt": "x" * 600, "max_tokens": 10}, 400, "context window"),
    ({"model": "tiny", "prompt": [1, 2, 99999]}, 400, "vocabulary"),
    ({"model": "tiny", "prompt": "x", "temperature": 10**400}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": -(10**400)}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x\ud800"}, 400, "lone surrogate"),
    ({"model": "tiny", "prompt": "x", "metadata": {"domain": ["code"]}}, 400, "metadata.domain"),
])
async def test_bad_requests_get_openai_style_4xx(client, body, status, needle) -> None:
    response = await client.post("/v1/completions", json=body)
    assert response.status == status
    error = (await response.json())["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


async def test_the_engines_refusals_name_the_field_and_code_at_fault(client) -> None:
    too_long = await (await client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 600})).json()
    assert too_long["error"]["code"] == "context_length_exceeded"
    outside = await (await client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 99999]})).json()
    assert outside["error"]["param"] == "prompt"


async def test_malformed_json_and_unknown_route_are_json_errors(client) -> None:
    response = await client.post("/v1/chat/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    assert response.status == 400 and "not valid JSON" in (await response.json())["error"]["message"]
    assert (await client.get("/v1/nothing")).status == 404
    wrong_method = await client.get("/v1/completions")
    assert wrong_method.status == 405 and "POST" in wrong_method.headers.get("Allow", "")  # as HTTP asks
    assert wrong_method.content_type == "application/json"
    bad_messages = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": 1}]})
    assert bad_messages.status == 400
    for body, needle in ((b"[" * 5000, "nested too deeply"), (b"[1, 2]", "must be a JSON object"),
                         (b'{"max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON")):
        response = await client.post("/v1/completions", data=body, headers={"Content-Type": "application/json"})
        assert response.status == 400 and needle in (await response.json())["error"]["message"]


async def test_unsupported_fields_sent_at_their_no_op_values_are_served(client) -> None:
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    plain = await (await client.post("/v1/chat/completions", json=body)).json()
    no_ops = {"logprobs": False, "echo": False, "best_of": 1, "logit_bias": {}, "presence_penalty": 0.0,
              "frequency_penalty": 0, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
              "top_k": -1, "min_tokens": 0, "ignore_eos": False, "stop_token_ids": [], "skip_special_tokens": True}
    response = await client.post("/v1/chat/completions", json={**body, **no_ops})
    assert response.status == 200
    assert (await response.json())["choices"][0]["message"] == plain["choices"][0]["message"]
    # vLLM's extras, asking for something this server does not do, are refused by name as OpenAI's are
    for name, value in (("top_k", 5), ("min_tokens", 5), ("ignore_eos", True), ("stop_token_ids", [5]),
                        ("guided_choice", ["a", "b"])):
        refused = await client.post("/v1/chat/completions", json={**body, name: value})
        assert refused.status == 400 and (await refused.json())["error"]["param"] == name
    # a boolean is not the number it equals in Python
    refused = await client.post("/v1/chat/completions", json={**body, "frequency_penalty": False})
    assert refused.status == 400 and (await refused.json())["error"]["param"] == "frequency_penalty"


async def test_chat_content_may_be_a_list_of_text_parts_and_other_parts_are_refused(client) -> None:
    def body(content: Any) -> dict[str, Any]:
        return {"model": "tiny", "max_tokens": 6, "temperature": 0,
                "messages": [{"role": "user", "content": content}]}

    as_text = await (await client.post("/v1/chat/completions", json=body("Hello there"))).json()
    as_parts = await (await client.post("/v1/chat/completions", json=body(
        [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]))).json()
    assert as_parts["choices"][0]["message"] == as_text["choices"][0]["message"]
    image = await client.post("/v1/chat/completions", json=body(
        [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]))
    assert image.status == 400 and "image_url" in (await image.json())["error"]["message"]
    odd_type = await client.post("/v1/chat/completions", json=body([{"type": ["text"], "text": "x"}]))
    assert odd_type.status == 400 and "only text content parts" in (await odd_type.json())["error"]["message"]
    earlier_turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
    null_reply = await client.post("/v1/chat/completions", json={**body("again"), "messages": [
        *earlier_turns, {"role": "user", "content": "again"}]})
    assert null_reply.status == 200  # OpenAI allows an assistant turn without content


@pytest.mark.parametrize("settings", [{"temperature": 1e-40}, {"temperature": 1.0, "top_p": 1e-50, "seed": 5}])
async def test_a_temperature_or_top_p_too_small_for_float32_decodes_greedily(client, settings) -> None:
    # such settings mean greedy; taken literally they overflowed float32 into NaN probabilities
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 12, **settings}
    answer = await (await client.post("/v1/completions", json=body)).json()
    assert answer["choices"][0]["text"] == target_only_text(client, "hello", 12)


async def test_requests_beyond_the_queue_bound_get_429_with_retry_after(client) -> None:
    state = api_state(client)
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "temperature": 0}
    state.max_queued = 0  # every new request would wait beyond the bound
    busy = await client.post("/v1/completions", json=body)
    assert busy.status == 429 and busy.headers["Retry-After"] == "1"
    assert (await busy.json())["error"]["type"] == "rate_limit_error"
    state.max_queued = 64
    assert state.worker.queued == 0
    assert (await client.post("/v1/completions", json=body)).status == 200


def queued_submission(request_id: str | None = None) -> Submission:
    """A two-token request that a test puts in a worker's inbox; its callbacks are never reached."""
    return Submission([1, 2], SamplingParams(max_tokens=2), print, print, print, request_id=request_id)


def idle_engine(client: TestClient) -> Engine:
    """An engine of the client's target that no decoding thread steps: its line stays as a test sets it."""
    return Engine(api_state(client).loaded.model, None, EngineConfig(max_batch=2))


def occupy_every_slot(engine: Engine) -> list[Sequence]:
    """Running rows in every batch slot, as if the decoding thread were inside a long step."""
    rows = [Sequence(f"busy-{i}", [1, 2], SamplingParams(max_tokens=8)) for i in range(engine.config.max_batch)]
    engine.running.extend(rows)
    return rows


async def test_cancellations_waiting_in_the_inbox_do_not_count_as_queued_requests(client) -> None:
    engine = idle_engine(client)
    worker = EngineWorker(engine)  # not started: everything stays in its inbox
    occupy_every_slot(engine)
    for i in range(5):
        worker.cancel(f"gone-{i}")
    assert worker.queued == 0
    worker.submit(queued_submission())
    assert worker.queued == 1


async def test_a_request_cancelled_before_it_left_the_inbox_holds_no_place_in_line(client) -> None:
    engine = idle_engine(client)
    worker = EngineWorker(engine)  # not started: everything stays in its inbox
    occupy_every_slot(engine)
    for i in range(3):
        worker.submit(queued_submission(f"r{i}"))
    assert worker.queued == 3
    worker.cancel("r1")   # its client went away before a step boundary
    assert worker.queued == 2
    worker.cancel("r1")   # a second cancellation of the same request changes nothing
    assert worker.queued == 2


async def test_requests_that_free_slots_will_take_at_the_next_step_are_not_queued(client) -> None:
    engine = idle_engine(client)
    worker = EngineWorker(engine)  # not started: as if the decoding thread were inside a long step
    slots = engine.config.max_batch
    for i in range(slots):  # an idle engine: each of these gets a slot at the next step boundary
        worker.submit(queued_submission(f"r{i}"))
    assert worker.queued == 0
    worker.submit(queued_submission("one-more"))
    assert worker.queued == 1


async def test_a_running_row_whose_client_left_counts_as_a_free_slot_at_once(client) -> None:
    engine = idle_engine(client)
    worker = EngineWorker(engine)  # not started: the cancelled row stays in its slot until a step boundary
    rows = occupy_every_slot(engine)
    worker.submit(queued_submission("waits"))
    assert worker.queued == 1
    worker.cancel(rows[0].request_id)   # its client went away
    assert worker.queued == 0
    rows[1].finish_reason = "length"    # finished: retired at the next step boundary
    worker.submit(queued_submission("takes-it"))
    assert worker.queued == 0


async def test_a_waiting_request_whose_client_left_leaves_the_count_before_the_next_step(client) -> None:
    engine = idle_engine(client)
    worker = EngineWorker(engine)  # not started: as if the decoding thread were inside a long step
    occupy_every_slot(engine)
    seq = engine.add_request([1, 2], SamplingParams(max_tokens=2), "waiting-1")
    worker._active["waiting-1"] = Submission([1, 2], SamplingParams(max_tokens=2), print, print, print,
                                             request_id="waiting-1", seq=seq)
    assert worker.queued == 1
    worker.cancel("waiting-1")
    assert worker.queued == 0


async def test_client_chosen_domain_labels_are_bounded(client) -> None:
    from specd.serving.http.api import MAX_DOMAINS, OTHER_DOMAIN

    body = {"model": "tiny", "prompt": "abc", "max_tokens": 2, "temperature": 0}
    for i in range(MAX_DOMAINS + 5):
        response = await client.post("/v1/completions", json=body, headers={"X-Specd-Domain": f"d{i}"})
        assert response.status == 200
    state = api_state(client)
    assert len(state.domains) == MAX_DOMAINS and f"d{MAX_DOMAINS}" not in state.domains

    async def counted() -> bool:
        labels = {domain for _, _, domain in state.metrics.totals}
        return OTHER_DOMAIN in labels and len(labels) == MAX_DOMAINS + 1

    await eventually(counted)


async def test_a_request_whose_prefill_fails_gets_500_and_its_neighbours_are_served(client, monkeypatch) -> None:
    state = api_state(client)
    engine = state.worker.engine
    start = engine._start
    poison = state.loaded.encode("boom")

    def faulty(part):
        if part.seq.prompt_ids == poison:
            raise RuntimeError("a fault traced to this request")
        start(part)

    monkeypatch.setattr(engine, "_start", faulty)
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    fine = [client.post("/v1/completions", json={**body, "prompt": f"fine {i}"}) for i in range(3)]
    answers = await asyncio.gather(client.post("/v1/completions", json={**body, "prompt": "boom"}), *fine)
    assert answers[0].status == 500 and "traced to this request" in (await answers[0].json())["error"]["message"]
    for i, answer in enumerate(answers[1:]):
        assert answer.status == 200
        assert (await answer.json())["choices"][0]["text"] == target_only_text(client, f"fine {i}", 8)


async def test_an_engine_fault_mid_stream_ends_the_stream_with_an_error_event_and_done(client, monkeypatch) -> None:
    engine = api_state(client).worker.engine
    step, calls = engine.step, []

    def failing_later():
        calls.append(1)
        if len(calls) == 4:  # tokens have been streamed by then
            raise RuntimeError("the engine broke")
        return step()

    monkeypatch.setattr(engine, "step", failing_later)
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 30, "temperature": 0, "stream": True}
    response = await client.post("/v1/completions", json=body)
    events = [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert response.status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "the engine broke" in error["message"] and error["type"] == "server_error"
    assert any("choices" in json.loads(e) for e in events[:-2])  # it did stream before the fault
    # the decoding thread is supervised: the fault is counted where operators see background failures
    background = (await (await client.get("/health")).json())["background"]
    assert background["engine"]["failures"] == 1 and "the engine broke" in background["engine"]["last_error"]
    metrics = await (await client.get("/metrics")).text()
    assert 'specd_background_failures_total{task="engine"} 1.0' in metrics
    again = await client.post("/v1/completions", json={**body, "stream": False})
    assert again.status == 200  # and serving goes on


async def test_a_client_callback_that_raises_fails_its_step_not_the_decoding_thread(client) -> None:
    worker = api_state(client).worker
    seen: list[Failure] = []

    def broken(tokens: list[int]) -> None:
        raise RuntimeError("a callback that should only hand data over did not")

    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def failed(error: Failure) -> None:  # on the worker thread
        seen.append(error)
        loop.call_soon_threadsafe(done.set_result, True)

    worker.submit(Submission([1, 2, 3], SamplingParams(max_tokens=6), broken, lambda seq: None, failed))
    await asyncio.wait_for(done, 30)
    assert seen and seen[0][0] == 500
    assert worker._thread is not None and worker._thread.is_alive()
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "temperature": 0}
    assert (await client.post("/v1/completions", json=body)).status == 200


async def test_an_api_key_guards_the_openai_routes_only(client) -> None:
    api_state(client).api_key = "s3cret"
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = await client.post("/v1/completions", json=body, headers=headers)
        assert refused.status == 401 and (await refused.json())["error"]["code"] == "invalid_api_key"
    assert (await client.get("/v1/models")).status == 401
    assert (await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})).status == 200
    assert (await client.get("/health")).status == 200 and (await client.get("/metrics")).status == 200


async def test_an_empty_api_key_leaves_the_openai_routes_open(client) -> None:
    api_state(client).api_key = ""  # `SPECD_API_KEY= specd serve`: no key, as with --token
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 2}
    assert (await client.post("/v1/completions", json=body)).status == 200
    assert (await client.get("/v1/models")).status == 200


async def test_models_and_health(client) -> None:
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 512
    health = await (await client.get("/health")).json()
    assert health["status"] == "ok" and health["drafter_version"] == 0
    assert health["running"] == health["waiting"] == health["records_published"] == 0


def record_sequences(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> list[Sequence]:
    """Every request the engine admits from now on, in order (the engine's own counts)."""
    engine = api_state(client).worker.engine
    admitted: list[Sequence] = []
    add_request = engine.add_request

    def recording(*args, **kwargs) -> Sequence:
        admitted.append(add_request(*args, **kwargs))
        return admitted[-1]

    monkeypatch.setattr(engine, "add_request", recording)
    return admitted


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus exposition -> {(sample name, sorted labels): value}."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def kept_per_step(seq: Sequence) -> list[int]:
    """Accepted drafts each step emitted: a step emits up to the next step's position."""
    ends = [step.position for step in seq.steps[1:]] + [seq.num_tokens]
    return [min(step.num_accepted, end - step.position) for step, end in zip(seq.steps, ends, strict=True)]


TRAFFIC = [  # (body, headers, domain): greedy and seeded sampled requests in three domains
    ({"prompt": "def f(x):", "max_tokens": 24, "temperature": 0, "metadata": {"domain": "code"}}, {}, "code"),
    ({"prompt": "def g(y): return y", "max_tokens": 17, "temperature": 0.8, "seed": 3,
      "metadata": {"domain": "code"}}, {}, "code"),
    ({"prompt": "hello hello hello", "max_tokens": 30, "temperature": 0}, {"X-Specd-Domain": "chat"}, "chat"),
    ({"prompt": "abc", "max_tokens": 9, "temperature": 0}, {}, "default"),
]


async def test_metrics_and_reports_count_exactly_the_traffic_sent(client, monkeypatch) -> None:
    admitted = record_sequences(client, monkeypatch)
    # fixed k: the lookahead controller picks k from measured times, which would make the counts timing-dependent
    engine = api_state(client).worker.engine
    monkeypatch.setattr(engine, "lookahead", LookaheadController(LookaheadConfig(max_k=engine.k, adaptive=False)))
    completion_tokens = []
    for body, headers, _ in TRAFFIC:  # one at a time: the engine admits them in this order
        answer = await (await client.post("/v1/completions", json={"model": "tiny", **body}, headers=headers)).json()
        completion_tokens.append(answer["usage"]["completion_tokens"])
    assert completion_tokens == [body["max_tokens"] for body, _, _ in TRAFFIC]
    assert [s.num_output_tokens for s in admitted] == completion_tokens
    versions = {step.drafter_version for seq in admitted for step in seq.steps}
    assert versions == {0}  # no swap: every step was verified under the day-0 drafter
    kept = [n for seq in admitted for n in kept_per_step(seq)]
    by_source = counts_by_source(admitted)
    # "hello hello hello" repeats itself: context matching drafts some steps, the learned drafter others
    assert {"learned", "context"} <= set(by_source) and by_source["learned"].drafts > 0
    assert sum(c.drafts for c in by_source.values()) == sum(s.num_drafts_proposed for s in admitted)
    assert sum(c.emitted for c in by_source.values()) == sum(completion_tokens)

    metrics = scrape(await (await client.get("/metrics")).text())
    for source, counts in by_source.items():  # each source's own drafts, nothing of another's
        labels = (("source", source), ("version", "0"))
        assert metrics["specd_spec_decode_num_draft_tokens_total", labels] == counts.drafts
        assert metrics["specd_spec_decode_num_accepted_tokens_total", labels] == counts.accepted
        assert metrics["specd_spec_decode_num_verification_passes_total", labels] == counts.passes
        assert metrics["specd_spec_decode_num_emitted_tokens_total", labels] == counts.emitted
        if counts.drafts:
            assert metrics["specd_spec_decode_acceptance_rate", labels] == pytest.approx(counts.acceptance_rate)
        assert metrics["specd_spec_decode_accept_length", labels] == pytest.approx(counts.accept_length)
    per_position = {dict(labels)["position"]: value for (name, labels), value in metrics.items()
                    if name == "specd_spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_position == {str(position): sum(n > position for n in kept) for position in range(max(kept))}
    assert metrics["specd_request_latency_seconds_count", ()] == len(TRAFFIC)
    assert metrics["specd_drafter_swaps_total", ()] == 0

    reports = {report.domain: report for report in api_state(client).metrics.reports("specd-0")}
    assert set(reports) == {"code", "chat", "default"}
    for domain, report in reports.items():
        seqs = [seq for seq, (_, _, d) in zip(admitted, TRAFFIC, strict=True) if d == domain]
        expected = counts_by_source(seqs)
        assert report.server_id == "specd-0"
        assert {source: counts.as_dict() for source, counts in report.sources.items()} == \
            {source: counts.as_dict() for source, counts in expected.items()}
        # the version's figures are the learned drafter's own: what the canary judges it by
        learned = expected.get("learned")
        assert report.versions == ({0: learned} if learned is not None else {})

    # no learner and no broker here: nothing would read a record (about 6 KB a token with the bundled
    # target's features, and the bus would keep thousands), so none is made and no feature is kept
    assert scrape(await (await client.get("/metrics")).text())["specd_records_published_total", ()] == 0
    assert api_state(client).worker.bus is None and not engine.config.record_features


async def test_acceptance_series_is_labelled_by_domain(client) -> None:
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    await client.post("/v1/completions", json={**body, "metadata": {"domain": "code"}})
    await client.post("/v1/completions", json=body, headers={"X-Specd-Domain": "chat"})

    async def both_domains_reported() -> bool:  # the report loop runs every 0.1 s
        series = (await (await client.get("/v1/acceptance")).json())["series"]
        return {"code", "chat"} <= {point["domain"] for point in series}

    await eventually(both_domains_reported)


async def test_operators_see_how_full_the_traffic_table_is_in_health_and_metrics(client) -> None:
    before = (await (await client.get("/health")).json())["traffic_table"]
    assert before["contexts"] == 0 and before["sequences_added"] == 0 and before["max_contexts"] > 0
    body = {"model": "tiny", "prompt": "the table learns from every finished request", "max_tokens": 6}
    assert (await client.post("/v1/completions", json=body)).status == 200

    async def tabled() -> bool:
        return (await (await client.get("/health")).json())["traffic_table"]["sequences_added"] == 1
    await eventually(tabled)
    contexts = (await (await client.get("/health")).json())["traffic_table"]["contexts"]
    assert contexts > 0
    metrics = await (await client.get("/metrics")).text()
    assert f"specd_traffic_table_contexts {float(contexts)}" in metrics
