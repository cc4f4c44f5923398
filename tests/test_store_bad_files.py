"""A damaged or odd weight store, a bad --url, a reused demo store: each is one clear line, never a traceback.

A truncated or mistyped live.json or manifest is a `StoreCorrupt` naming the file, and nothing
rewrites or deletes it; a server refuses a version whose manifest is damaged and keeps serving;
`specd versions` lists what it can. The control-plane client refuses URLs and answers it cannot use.
Stores are built from tiny drafters; no model is loaded.
"""

from __future__ import annotations

import http.server
import json
import logging
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TINY, tiny_target

from specd.cli.main import build_parser, main
from specd.core.errors import ConfigurationError, StoreError
from specd.demo.deployment import DemoConfig, check_new_store, run_demo
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.hotswap.store import StoreCorrupt, WeightStore
from specd.hotswap.swapper import LocalStore, Swapper
from specd.model.fingerprint import TargetFingerprint

FINGERPRINT = TargetFingerprint(TINY.vocab_size, "none")
SHAPE = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


def publish(store: WeightStore, seed: int, live: bool = True) -> int:
    version = store.publish(new_drafter_model(tiny_target(), SHAPE, seed=seed), FINGERPRINT, store.live_version(), {})
    if live:
        store.set_live(version)
    return version


def three_live_versions(root: Path) -> WeightStore:
    """Versions 1, 2, 3, each live in turn: 3 is live, 1 and 2 are its history."""
    store = WeightStore(root)
    for seed in range(3):
        publish(store, seed)
    return store


@pytest.fixture
def store(tmp_path: Path) -> WeightStore:
    return three_live_versions(tmp_path / "store")


def manifest_path(store: WeightStore, version: int) -> Path:
    return store.version_dir(version) / "manifest.json"


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("specd: error:") and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("content", ['{"version": 3, "hist', "[]", '{"version": "3", "history": []}',
                                     '{"version": 3, "history": "1,2"}', "\xff\xfe"])
@pytest.mark.parametrize("command", [["versions"], ["status"], ["rollback"], ["rollback", "1"]])
def test_a_damaged_live_json_is_one_error_line_naming_it(store: WeightStore, capsys, content: str,
                                                         command: list[str]) -> None:
    (store.root / "live.json").write_text(content, encoding="latin-1")
    err = one_error_line(capsys, [*command, "--store", str(store.root)])
    assert str(store.root / "live.json") in err
    assert (store.root / "live.json").read_text(encoding="latin-1") == content  # the evidence is left as found


@pytest.mark.parametrize("content", ['{"version": 2, "sta', "[1, 2]", ""])
def test_a_damaged_manifest_is_refused_naming_its_file_and_never_rewritten(store: WeightStore, capsys,
                                                                           content: str) -> None:
    path = manifest_path(store, 2)
    path.write_text(content)
    with pytest.raises(StoreCorrupt, match=r"000002/manifest\.json"):
        store.manifest(2)
    for command in (["pin", "2"], ["rollback", "2"], ["rollback"]):  # plain rollback picks 2, the one before 3
        assert "000002/manifest.json" in one_error_line(capsys, [*command, "--store", str(store.root)])
    assert path.read_text() == content and store.live_version() == 3


def test_versions_lists_the_readable_manifests_and_marks_a_damaged_one(store: WeightStore, capsys) -> None:
    manifest_path(store, 2).write_text("{")
    assert main(["versions", "--store", str(store.root)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == "live: 3"
    assert "unreadable" in rows[3] and "000002/manifest.json" in rows[3]
    assert rows[2].split()[:2] == ["1", "retired"] and rows[4].split()[:2] == ["3", "live"]
    assert main(["versions", "--store", str(store.root), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [m["status"] for m in listing["versions"]] == ["retired", "unreadable", "live"]


def test_a_version_folder_copied_in_by_hand_is_listed_under_its_folders_number(store: WeightStore, capsys) -> None:
    shutil.copytree(store.version_dir(1), store.version_dir(4))  # its manifest still says version 1
    assert main(["versions", "--store", str(store.root), "--json"]) == 0
    assert [m["version"] for m in json.loads(capsys.readouterr().out)["versions"]] == [1, 2, 3, 4]


@pytest.mark.parametrize("manifest", [{}, {"version": 2, "status": "retired"}, {"created": "yesterday"}])
def test_versions_shows_a_dash_for_a_field_a_manifest_lacks(store: WeightStore, capsys, manifest: dict) -> None:
    manifest_path(store, 2).write_text(json.dumps(manifest))
    assert main(["versions", "--store", str(store.root)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 6 and rows[3].split()[0] == "2" and rows[3].endswith(" -")
    assert rows[-1].startswith("accept len: the gate's replay")


def test_gc_keeps_a_version_whose_manifest_is_damaged(tmp_path: Path) -> None:
    store = WeightStore(tmp_path, keep_last=1, keep_live_within_s=0)
    first = publish(store, 0, live=False)
    for seed in range(1, 4):
        publish(store, seed)
    manifest_path(store, first).write_text("not json")
    removed = store.gc()
    assert first not in removed and removed and manifest_path(store, first).read_text() == "not json"


def test_a_live_version_with_a_damaged_manifest_can_still_be_left(store: WeightStore) -> None:
    manifest_path(store, 3).write_text("{")
    fourth = publish(store, 3)  # promotion away from it
    assert store.live_version() == fourth and manifest_path(store, 3).read_text() == "{"
    manifest_path(store, 4).write_text("[]")
    assert store.rollback(to=2) == 2  # and a rollback away from a damaged one too


def test_a_server_refuses_a_version_with_a_damaged_manifest_and_keeps_serving(store: WeightStore, caplog) -> None:
    drafter = TokenDrafter(new_drafter_model(tiny_target(), SHAPE, seed=2), 3)
    candidate = publish(store, 7)
    manifest_path(store, candidate).write_text('{"sha256": ')
    swapper = Swapper(LocalStore(store), drafter, FINGERPRINT)
    assert not swapper.check_once()
    assert candidate in swapper.refused and "manifest.json" in swapper.refused[candidate]
    assert drafter.version == 3
    (store.root / "live.json").write_text("[")
    with caplog.at_level(logging.WARNING, logger="specd.hotswap.swapper"):
        for _ in range(5):  # an unreadable live pointer: nothing changes, no exception
            assert not swapper.check_once()
    assert sum("cannot read the store's live version" in r.message for r in caplog.records) == 1  # said once


def test_the_control_plane_lists_the_readable_versions_beside_a_damaged_one(store: WeightStore) -> None:
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from specd.control.acceptance import AcceptanceLog
    from specd.control.plane import ControlPlane, add_control_routes

    manifest_path(store, 2).write_text("{")

    async def listing() -> dict:
        app = web.Application()
        add_control_routes(app, ControlPlane(store, AcceptanceLog(), "token"))
        async with TestClient(TestServer(app)) as client:
            response = await client.get("/v1/versions")
            assert response.status == 200
            return await response.json()

    answer = asyncio.run(listing())
    assert [(m["version"], m["status"]) for m in answer["versions"]] == [(1, "retired"), (2, "unreadable"),
                                                                          (3, "live")]


def test_the_canary_stands_aside_while_the_live_pointer_is_damaged(store: WeightStore) -> None:
    from specd.learner.shadow import ShadowCanary

    canary = ShadowCanary(store, lambda v: None, lambda model, records: 0.0, margin=0.05, min_records=1, z=2.33,
                          every=1)
    assert canary._live_pair() == (3, 2)
    (store.root / "live.json").write_text("[")
    assert canary._live_pair() is None


def test_a_regular_file_is_no_store_folder(tmp_path: Path, capsys) -> None:
    plain = tmp_path / "plain"
    plain.write_text("x")
    with pytest.raises(StoreError, match="cannot be a weight store folder"):
        WeightStore(plain)
    with pytest.raises(StoreError, match="cannot be a weight store folder"):
        WeightStore(plain / "below")
    assert "not a specd weight store" in one_error_line(capsys, ["versions", "--store", str(plain)])


def test_rollback_says_the_earlier_versions_files_are_missing(store: WeightStore, capsys) -> None:
    for version in (1, 2):
        store.weights_path(version).unlink()
    err = one_error_line(capsys, ["rollback", "--store", str(store.root)])
    assert "files missing" in err and "(2, 1)" in err
    assert "2's weights are missing" in one_error_line(capsys, ["rollback", "2", "--store", str(store.root)])


def test_versions_says_when_the_live_pointer_names_a_missing_version(store: WeightStore, capsys) -> None:
    (store.root / "live.json").write_text(json.dumps({"version": 7, "history": [1, 2, 3]}))
    assert main(["versions", "--store", str(store.root)]) == 0
    assert "missing" in capsys.readouterr().out.splitlines()[0]
    assert main(["versions", "--store", str(store.root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["live_missing"] is True
    (store.root / "live.json").write_text(json.dumps({"version": 3, "history": [1, 2]}))
    assert main(["versions", "--store", str(store.root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["live_missing"] is False


class Answers(http.server.ThreadingHTTPServer):
    """A control plane that answers every GET with the body it is given, status 200."""

    daemon_threads = True
    body = b""


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.server.body)  # type: ignore[attr-defined]

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answers() -> Iterator[Answers]:
    server = Answers(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("url", ["notaurl", "ftp://host/x", "http://", "http://127.0.0.1:notaport"])
def test_a_url_that_is_not_http_is_a_configuration_error(capsys, url: str) -> None:
    assert "URL" in one_error_line(capsys, ["status", "--url", url])


@pytest.mark.parametrize(("body", "needle"), [(b"<html>hello</html>", "not JSON"), (b"[1, 2]", "JSON list"),
                                              (b'{"live": 1, "versions": 3}', "'versions'")])
@pytest.mark.parametrize("command", [["status"], ["versions"]])
def test_an_answer_that_is_not_the_json_object_asked_for_is_a_transport_error(answers: Answers, capsys, body: bytes,
                                                                              needle: str, command: list[str]) -> None:
    answers.body = body
    url = f"http://127.0.0.1:{answers.server_address[1]}"
    if command == ["status"] and needle == "'versions'":
        assert main([*command, "--url", url]) == 0  # any object is a status
        return
    assert needle in one_error_line(capsys, [*command, "--url", url])


def test_the_demo_refuses_a_store_an_earlier_run_left_before_writing_anything(store: WeightStore) -> None:
    before = sorted(p.relative_to(store.root) for p in store.root.rglob("*"))
    with pytest.raises(ConfigurationError, match="new or empty store folder"):
        run_demo(None, [], DemoConfig(), store.root)  # type: ignore[arg-type]  # refused before the model is used
    assert sorted(p.relative_to(store.root) for p in store.root.rglob("*")) == before


def test_the_demo_takes_a_new_or_empty_store_folder(tmp_path: Path) -> None:
    check_new_store(tmp_path / "new")
    WeightStore(tmp_path / "empty")
    check_new_store(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigurationError, match="is a file"):
        check_new_store(tmp_path / "file")


def test_store_commands_help_says_what_each_argument_does() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    helps = {name: {a.dest: a.help for a in parser._actions} for name, parser in sub.choices.items()}  # type: ignore[attr-defined]
    assert helps["versions"]["json"] and helps["pin"]["version"] and helps["pin"]["unpin"]
    assert "earlier or later" in helps["rollback"]["version"]
    rollback = next(c for c in sub._choices_actions if c.dest == "rollback")  # type: ignore[attr-defined]
    assert "earlier version live again" not in rollback.help


def test_a_version_the_full_disk_cannot_hold_is_refused_naming_the_store_and_leaves_nothing(
        store: WeightStore, monkeypatch) -> None:
    import specd.hotswap.store as store_module

    before = store.versions()

    def full(*args, **kwargs) -> None:
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(store_module, "save_drafter", full)
    with pytest.raises(StoreError, match=f"cannot write version {before[-1] + 1} to the store {store.root}"):
        publish(store, 9)
    assert store.versions() == before
    assert [p.name for p in (store.root / "versions").iterdir() if p.name.startswith(".")] == []  # no staging left
