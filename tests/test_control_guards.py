"""What an operator's control request cannot do by mistake: make live a version servers would
refuse, roll back two steps with one intent, pin when they meant to unpin, or get a 500 or a
plain-text page for a request the plane refuses.

Stores are built from tiny drafters (versions 1, 2, 3, each live in turn); no model is loaded.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_store_bad_files import FINGERPRINT, SHAPE

from specd.control.acceptance import AcceptanceLog
from specd.control.plane import MAX_CONTROL_BODY_BYTES, ControlPlane, add_control_routes, control_app
from specd.drafter.token_drafter import new_drafter_model
from specd.hotswap.integrity import sha256_file
from specd.hotswap.store import WeightStore
from specd.model.fingerprint import TargetFingerprint

TOKEN = "secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def store(tmp_path: Path) -> WeightStore:
    from test_store_bad_files import three_live_versions

    return three_live_versions(tmp_path / "store")


def plane_app(store: WeightStore, **plane: Any) -> web.Application:
    app = control_app()
    add_control_routes(app, ControlPlane(store, AcceptanceLog(), TOKEN, fingerprint=FINGERPRINT, **plane))
    return app


async def _ask(app: web.Application, requests: list[tuple[str, str, Any]]) -> list[tuple[int, str, Any]]:
    answers = []
    async with TestClient(TestServer(app)) as client:
        for method, path, body in requests:
            data = body if isinstance(body, bytes) else json.dumps(body) if body is not None else None
            response = await client.request(method, path, data=data, headers=AUTH)
            content = await response.json() if response.content_type == "application/json" else await response.text()
            answers.append((response.status, response.content_type, content))
    return answers


def ask(app: web.Application, *requests: tuple[str, str, Any]) -> list[tuple[int, str, Any]]:
    return asyncio.run(_ask(app, list(requests)))


def copy_in_by_hand(store: WeightStore, version: int, damage: str) -> None:
    """Replace a version's weights as someone copying files by hand might, with the manifest's
    digest updated to match: the sha256 alone cannot tell."""
    path = store.weights_path(version)
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(str(path))
    if damage == "nan":
        first = sorted(tensors)[0]
        tensors[first] = tensors[first].clone().fill_(float("nan"))
        save_file(tensors, str(path), metadata=metadata)
    else:
        path.write_bytes(b"not a safetensors file at all")
    match_digest(store, version)


def match_digest(store: WeightStore, version: int) -> None:
    """The manifest's sha256 updated to the file's, as a careful copy by hand would leave it."""
    manifest_path = store.version_dir(version) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "sha256": sha256_file(store.weights_path(version))}))


@pytest.mark.parametrize("damage", ["nan", "garbage"])
def test_a_version_that_served_is_checked_as_servers_would_before_it_goes_live_again(store: WeightStore,
                                                                                    damage: str) -> None:
    copy_in_by_hand(store, 2, damage)
    answers = ask(plane_app(store), ("POST", "/v1/live", {"version": 2}), ("POST", "/v1/rollback", {"version": 2}),
                  ("POST", "/v1/rollback", None))  # the default choice is version 2 too
    assert [status for status, _, _ in answers] == [409, 409, 409]
    for _, _, body in answers:
        assert body["error"]["message"].startswith("version 2 cannot go live:")
    assert store.live_version() == 3 and store.manifest(3)["status"] == "live"


def test_a_version_whose_files_are_gone_is_still_a_404_naming_them(store: WeightStore) -> None:
    store.weights_path(2).unlink()
    answers = ask(plane_app(store), ("POST", "/v1/rollback", {"version": 2}), ("POST", "/v1/live", {"version": 2}))
    assert [status for status, _, _ in answers] == [404, 404]
    assert "weights are missing" in answers[0][2]["error"]["message"] and store.live_version() == 3


def test_a_version_for_another_target_is_not_made_live(store: WeightStore) -> None:
    other = TargetFingerprint(FINGERPRINT.vocab_size + 1, "none")
    from conftest import tiny_target

    version = store.publish(new_drafter_model(tiny_target(), SHAPE, seed=9), other, 3, {})
    [(status, _, body)] = ask(plane_app(store), ("POST", "/v1/live", {"version": version}))
    assert status == 409 and "cannot go live" in body["error"]["message"] and store.live_version() == 3


def test_a_candidate_servers_would_refuse_is_refused_before_the_gate_asks_for_evidence(store: WeightStore) -> None:
    from conftest import tiny_target

    version = store.publish(new_drafter_model(tiny_target(), SHAPE, seed=9), FINGERPRINT, 3, {})
    copy_in_by_hand(store, version, "nan")
    submitted: list[int] = []

    def submit(v: int) -> Any:
        submitted.append(v)
        raise AssertionError("the gate must not be asked")

    [(status, _, body)] = ask(plane_app(store, submit=submit), ("POST", "/v1/live", {"version": version}))
    assert status == 409 and "cannot go live" in body["error"]["message"] and not submitted


def test_two_default_rollbacks_at_once_go_back_one_step(store: WeightStore,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    plane = ControlPlane(store, AcceptanceLog(), TOKEN, fingerprint=FINGERPRINT)
    both_asked = threading.Event()  # both requests have read the version live when they came
    reads, live_version, check = [], store.live_version, plane.check

    def counted_live_version() -> int | None:
        reads.append(1)
        if len(reads) >= 2:
            both_asked.set()
        return live_version()

    def check_once_both_asked(version: int) -> None:
        assert both_asked.wait(10)
        check(version)

    monkeypatch.setattr(store, "live_version", counted_live_version)
    plane.check = check_once_both_asked  # type: ignore[method-assign]
    app = control_app()
    add_control_routes(app, plane)

    async def both() -> list[int]:
        async with TestClient(TestServer(app)) as client:
            sent = [client.post("/v1/rollback", headers=AUTH) for _ in range(2)]
            return sorted([response.status for response in await asyncio.gather(*sent)])

    assert asyncio.run(both()) == [200, 409]
    assert store.live_version() == 2 and store.live_state()["history"] == [1]


def test_a_rollback_against_the_version_the_operator_saw_is_taken_once(store: WeightStore) -> None:
    answers = ask(plane_app(store), ("POST", "/v1/rollback", {"if_live": 3}), ("POST", "/v1/rollback", {"if_live": 3}))
    assert [status for status, _, _ in answers] == [200, 409]
    assert answers[0][2] == {"live": 2} and "version 2 is live now, not 3" in answers[1][2]["error"]["message"]
    assert store.live_version() == 2


def test_a_field_a_route_does_not_take_is_refused_and_a_pin_says_what_it_did(store: WeightStore) -> None:
    answers = ask(plane_app(store), ("POST", "/v1/pin", {"version": 1, "unpinned": True}),
                  ("POST", "/v1/rollback", {"versoin": 1}), ("POST", "/v1/pin", {"version": 1, "pinned": True}),
                  ("POST", "/v1/pin", {"version": 1, "pinned": False}))
    assert [status for status, _, _ in answers] == [400, 400, 200, 200]
    assert "'unpinned'" in answers[0][2]["error"]["message"] and "'versoin'" in answers[1][2]["error"]["message"]
    assert answers[2][2] == {"live": 3, "version": 1, "pinned": True}
    assert answers[3][2] == {"live": 3, "version": 1, "pinned": False}
    assert not store.manifest(1)["pinned"] and store.live_version() == 3


def test_version_numbers_no_store_could_hold_are_a_404_and_odd_spellings_a_400(store: WeightStore) -> None:
    huge = "9" * 300
    answers = ask(plane_app(store), ("GET", f"/v1/versions/{huge}", None),
                  ("GET", f"/v1/versions/{huge}/weights", None),
                  ("POST", "/v1/live", f'{{"version": {huge}}}'.encode()),
                  ("POST", "/v1/pin", f'{{"version": {huge}}}'.encode()), ("POST", "/v1/pin", {"version": -1}),
                  ("GET", "/v1/versions/1_0", None), ("GET", "/v1/versions/+1", None),
                  ("GET", "/v1/versions/%EF%BC%91", None))  # a full-width one
    assert [(status, kind) for status, kind, _ in answers] == [(404, "application/json")] * 5 + \
        [(400, "application/json")] * 3


def test_a_plane_of_its_own_answers_unknown_routes_methods_and_large_bodies_in_json(store: WeightStore) -> None:
    answers = ask(plane_app(store), ("GET", "/v1/live", None), ("GET", "/v1/nope", None),
                  ("POST", "/v1/pin", b'{"version": 1, "note": "' + b"x" * MAX_CONTROL_BODY_BYTES + b'"}'))
    assert [(status, kind) for status, kind, _ in answers] == [(405, "application/json"), (404, "application/json"),
                                                               (413, "application/json")]
    assert str(MAX_CONTROL_BODY_BYTES) in answers[2][2]["error"]["message"]
    allowed = asyncio.run(_allow_of(plane_app(store), "/v1/live"))
    assert "POST" in allowed  # a 405 says which methods the route takes


async def _allow_of(app: web.Application, path: str) -> str:
    async with TestClient(TestServer(app)) as client:
        response = await client.get(path)
        assert response.status == 405
        return response.headers.get("Allow", "")


def test_a_server_and_the_learner_sidecar_check_an_operators_version_for_their_own_target(tmp_path: Path) -> None:
    from dataclasses import replace

    from conftest import tiny_target

    from specd.drafter.factory import DrafterSpec
    from specd.learner.sidecar import Sidecar, SidecarOptions
    from specd.serving.serve import ServeOptions, build_server
    from specd.testing import ByteTokenizer, tiny_loaded_target

    loaded = replace(tiny_loaded_target(), tokenizer=ByteTokenizer())
    foreign = TargetFingerprint(loaded.fingerprint.vocab_size + 1, "none")
    server = build_server(ServeOptions(store=str(tmp_path / "serve"), model_name="tiny",
                                       drafter=DrafterSpec(head_vocab=200)), loaded)
    sidecar = Sidecar(SidecarOptions(store=str(tmp_path / "learner")), loaded)
    try:
        sidecar_app = control_app()
        add_control_routes(sidecar_app, sidecar.plane)
        for app, store in ((server, WeightStore(tmp_path / "serve")), (sidecar_app, sidecar.store)):
            version = store.publish(new_drafter_model(tiny_target(), SHAPE, seed=9), foreign, None, {})
            [(status, _, body)] = ask(app, ("POST", "/v1/live", {"version": version}))
            assert status == 409 and "cannot go live" in body["error"]["message"]
            assert store.live_version() != version
    finally:
        sidecar.spool.close()
        sidecar.release()


def test_a_rollback_by_cli_on_a_store_folder_refuses_a_file_no_server_could_read(
        store: WeightStore, capsys: pytest.CaptureFixture[str]) -> None:
    from test_store_bad_files import one_error_line

    copy_in_by_hand(store, 2, "garbage")
    err = one_error_line(capsys, ["rollback", "2", "--store", str(store.root)])
    assert "version 2 cannot go live" in err and store.live_version() == 3
    copy_in_by_hand(store, 1, "nan")
    assert "non-finite" in one_error_line(capsys, ["rollback", "1", "--store", str(store.root)])
    assert store.live_version() == 3


def _replace_weights(store: WeightStore, version: int, model: Any, fingerprint: TargetFingerprint) -> None:
    """Version `version`'s file swapped for `model` saved for `fingerprint`, its digest updated to match."""
    from specd.drafter.checkpoint import save_drafter

    save_drafter(model, store.weights_path(version), fingerprint)
    match_digest(store, version)


def test_a_rollback_by_cli_on_a_store_folder_refuses_a_file_made_for_another_target_or_shape(
        store: WeightStore, capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import replace

    from conftest import tiny_target
    from test_store_bad_files import one_error_line

    foreign = TargetFingerprint(FINGERPRINT.vocab_size + 1, "none")
    _replace_weights(store, 2, new_drafter_model(tiny_target(), SHAPE, seed=9), foreign)
    err = one_error_line(capsys, ["rollback", "2", "--store", str(store.root)])
    assert "version 2 cannot go live" in err and "another target" in err and "--url" in err
    wider = replace(SHAPE, intermediate_size=2 * SHAPE.intermediate_size)
    _replace_weights(store, 1, new_drafter_model(tiny_target(), wider, seed=9), FINGERPRINT)
    assert "other shapes" in one_error_line(capsys, ["rollback", "1", "--store", str(store.root)])
    assert store.live_version() == 3


def test_a_rollback_by_cli_away_from_a_live_file_that_cannot_be_read_still_checks_the_rest(
        store: WeightStore, capsys: pytest.CaptureFixture[str]) -> None:
    from specd.cli.main import main

    copy_in_by_hand(store, 3, "garbage")  # nothing to compare with: the live file is the broken one
    assert main(["rollback", "--store", str(store.root)]) == 0
    assert "version 2 is live" in capsys.readouterr().out and store.live_version() == 2


def test_a_wrong_token_is_told_apart_from_a_missing_one(store: WeightStore) -> None:
    async def both() -> list[str]:
        async with TestClient(TestServer(plane_app(store))) as client:
            wrong = await client.post("/v1/pin", json={"version": 1}, headers={"Authorization": "Bearer nope"})
            missing = await client.post("/v1/pin", json={"version": 1})
            return [(await r.json())["error"]["message"] for r in (wrong, missing) if r.status == 401]

    wrong, missing = asyncio.run(both())
    assert "not this server's --token" in wrong and "not this server's" not in missing


def test_the_cli_says_what_the_server_pinned(store: WeightStore, capsys: pytest.CaptureFixture[str]) -> None:
    from specd.cli.main import main
    from specd.testing.processes import free_port

    port, started, stop = free_port(), threading.Event(), threading.Event()

    def serve() -> None:
        async def run() -> None:
            runner = web.AppRunner(plane_app(store))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await runner.cleanup()
        asyncio.run(run())

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        assert started.wait(10)
        url = f"http://127.0.0.1:{port}"
        assert main(["pin", "2", "--url", url, "--token", TOKEN]) == 0
        assert main(["pin", "2", "--unpin", "--url", url, "--token", TOKEN]) == 0
        assert capsys.readouterr().out.splitlines() == ["version 2 pinned", "version 2 unpinned"]
        assert not store.manifest(2)["pinned"]
    finally:
        stop.set()
        server.join(10)


def test_an_operators_check_runs_under_the_live_lock_so_no_one_acts_between_it_and_the_change(
        store: WeightStore) -> None:
    checking, release = threading.Event(), threading.Event()

    def slow_check(version: int) -> None:
        checking.set()
        assert release.wait(10)

    rollback = threading.Thread(target=store.operator_rollback, args=(2, 3, slow_check))
    rollback.start()
    assert checking.wait(10)
    promotion = threading.Thread(target=store.set_live, args=(1,))
    promotion.start()
    promotion.join(0.5)
    assert promotion.is_alive() and store.live_version() == 3  # waiting for the check to end
    release.set()
    rollback.join(10)
    promotion.join(10)
    assert store.live_version() == 1 and store.live_state()["history"][-1] == 2


def test_a_failed_check_changes_nothing_in_the_store(store: WeightStore) -> None:
    from specd.core.errors import StoreError

    def refuse(version: int) -> None:
        raise StoreError(f"version {version} cannot go live: planted")

    before = (store.live_state(), store.manifest(2), store.manifest(3))
    for act in (lambda: store.set_live(2, "operator", check=refuse), lambda: store.operator_rollback(2, 3, refuse)):
        with pytest.raises(StoreError, match="planted"):
            act()
        assert (store.live_state(), store.manifest(2), store.manifest(3)) == before
