"""Bodies and tokens of HTTP requests: whatever a client sends, a JSON 4xx that says why (a 408 for
a body that never arrives), never a 500 page of text; bearer schemes in any case; booleans that are
booleans; HEAD wherever GET is answered."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from specd.control.acceptance import AcceptanceLog
from specd.control.plane import ControlPlane, add_control_routes
from specd.core.errors import BadRequest, RequestRefused
from specd.core.http_requests import BodyIncomplete, bearer_matches, json_object, read_body
from specd.engine.request import SamplingParams
from specd.hotswap.store import WeightStore

TOKEN = "s3cret"


@pytest.mark.parametrize("raw", [b"\xff\xfe\x00", b"[" * 100_000, b"[1, 2]", b"{", b"1" * 5000, b""])
def test_any_bytes_that_are_not_a_json_object_are_a_bad_request(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        json_object(raw)


def test_a_json_object_is_read_as_a_dict() -> None:
    assert json_object(b'{"version": 3}') == {"version": 3}


class _Stalled:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    async def read(self) -> bytes:
        if self.error is not None:
            raise self.error
        await asyncio.sleep(60)
        return b""


def test_a_body_that_stops_arriving_or_is_cut_off_is_a_408() -> None:
    with pytest.raises(BodyIncomplete, match="within") as slow:
        asyncio.run(read_body(_Stalled(), timeout_s=0.05))
    assert slow.value.http_status == 408
    with pytest.raises(BodyIncomplete, match="closed the connection"):
        asyncio.run(read_body(_Stalled(ConnectionResetError("lost"))))


def test_the_bearer_scheme_is_matched_in_any_case_and_the_token_exactly() -> None:
    assert bearer_matches(f"Bearer {TOKEN}", TOKEN) and bearer_matches(f"bearer {TOKEN}", TOKEN)
    assert not bearer_matches(f"Bearer {TOKEN}x", TOKEN) and not bearer_matches("", TOKEN)
    assert not bearer_matches(f"Basic {TOKEN}", TOKEN)


def test_an_engine_refusal_names_the_field_at_fault() -> None:
    with pytest.raises(RequestRefused) as refused:
        SamplingParams(temperature=-1.0)
    assert refused.value.as_json()["error"]["param"] == "temperature"


async def _ask(store: WeightStore, requests: list[tuple[str, str, dict]]) -> list[tuple[int, str, object]]:
    app = web.Application()
    add_control_routes(app, ControlPlane(store, AcceptanceLog(), TOKEN))
    answers = []
    async with TestClient(TestServer(app)) as client:
        for method, path, kwargs in requests:
            response = await client.request(method, path, **kwargs)
            body = await response.json() if response.content_type == "application/json" else await response.text()
            answers.append((response.status, response.content_type, body))
    return answers


@pytest.fixture
def store(tmp_path: Path) -> WeightStore:
    from test_store_bad_files import publish

    store = WeightStore(tmp_path / "store")
    publish(store, 0)
    return store


def test_control_routes_answer_bad_bodies_with_a_json_400(store: WeightStore) -> None:
    auth = {"Authorization": f"bearer {TOKEN}"}  # the scheme in lower case is accepted
    bodies = [b"\xff\xfe\x00", b"[" * 100_000, b'{"version": 1, "pinned": "false"}', b'{"version": 1, "pinned": []}']
    answers = asyncio.run(_ask(store, [("POST", "/v1/pin", {"data": body, "headers": auth}) for body in bodies]))
    assert [(status, kind) for status, kind, _ in answers] == [(400, "application/json")] * len(bodies)
    assert "'pinned' must be true or false" in str(answers[2][2])
    assert not store.manifest(1).get("pinned")  # "false" did not pin it


def test_every_get_route_answers_head(store: WeightStore) -> None:
    answers = asyncio.run(_ask(store, [("HEAD", path, {}) for path in ("/v1/versions", "/v1/versions/1/weights",
                                                                      "/dashboard")]))
    assert [status for status, _, _ in answers] == [200, 200, 200]


def test_a_bug_in_a_control_route_is_a_json_500_and_a_logged_traceback(store: WeightStore, monkeypatch,
                                                                       caplog) -> None:
    def broken() -> list:
        raise RuntimeError("a bug")

    monkeypatch.setattr(store, "manifests", broken)
    with caplog.at_level(logging.ERROR, logger="specd.control.plane"):
        [(status, kind, body)] = asyncio.run(_ask(store, [("GET", "/v1/versions", {})]))
    assert (status, kind) == (500, "application/json") and body["error"]["type"] == "internal_error"
    assert any(record.exc_info for record in caplog.records)


def test_serve_reads_its_control_token_from_the_environment(monkeypatch, caplog) -> None:
    import argparse

    from specd.cli.service import control_token

    monkeypatch.setenv("SPECD_TOKEN", TOKEN)
    assert control_token(argparse.Namespace(token=None, host="127.0.0.1", port=8000)) == TOKEN
    monkeypatch.delenv("SPECD_TOKEN")
    with caplog.at_level(logging.WARNING, logger="specd.cli.service"):
        assert control_token(argparse.Namespace(token=None, host="0.0.0.0", port=8000)) is None
    assert "anyone who reaches 0.0.0.0:8000" in caplog.text
