"""One error hierarchy: each kind of failure reaches a person as the right message and status.

The CLI turns every `SpecdError` into one line `specd: error: ...` and exit status 2; the HTTP
layers turn it into a JSON error with the kind's status. A bad broker URL is a configuration
error, not a store error; an unreachable learner is a transport error.
"""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from specd.cli.main import main
from specd.control.acceptance import AcceptanceLog
from specd.control.plane import ControlPlane, add_control_routes
from specd.core import errors
from specd.drafter.token_drafter import DrafterShape, new_drafter_model
from specd.hotswap.store import WeightStore
from specd.model.fingerprint import TargetFingerprint
from specd.serving.vllm.shared.launch import PluginSettings
from specd.testing import tiny_target
from specd.transport.mqtt import MqttSettings


def publish_tiny_version(store: WeightStore) -> int:
    target = tiny_target()
    shape = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48)
    return store.publish(new_drafter_model(target, shape), TargetFingerprint.of(target.config), None, {})


def test_every_kind_is_a_specd_error_with_its_own_status() -> None:
    kinds = {errors.BadRequest: 400, errors.BadWeights: 422, errors.StoreError: 409,
             errors.VersionNotFound: 404, errors.TransportError: 502, errors.ConfigurationError: 400}
    for kind, status in kinds.items():
        assert issubclass(kind, errors.SpecdError) and kind.http_status == status
    for refusal in (errors.RequestRefused, errors.RecordRefused, errors.TrafficError):
        assert issubclass(refusal, errors.BadRequest)
    assert issubclass(errors.CheckpointError, errors.BadWeights)


def test_a_bad_broker_url_is_a_configuration_error() -> None:
    with pytest.raises(errors.ConfigurationError, match="broker URL"):
        MqttSettings.from_url("http://broker:1883")
    with pytest.raises(errors.ConfigurationError, match="broker URL"):
        PluginSettings.from_env({"SPECD_BROKER": "tcp://x"})


@pytest.mark.parametrize(("argv", "needle"), [
    (["serve", "--broker", "ftp://nowhere"], "broker URL"),
    (["learner", "--store", "somewhere"], "needs --broker"),
    (["versions", "--url", "http://127.0.0.1:9"], "unreachable"),
    (["vllm", "--print"], "needs --broker"),
])
def test_cli_reports_each_kind_as_one_line(argv, needle, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("specd: error:") and needle in err and "store" not in err.split(needle)[0]
    assert "Traceback" not in err and err.count("\n") == 1


def test_cli_store_errors_name_the_version(tmp_path, capsys) -> None:
    store = WeightStore(tmp_path / "store")
    store.set_live(publish_tiny_version(store))
    assert main(["rollback", "7", "--store", str(tmp_path / "store")]) == 2
    assert "version 7 does not exist" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_control_plane_answers_store_errors_with_their_status(tmp_path) -> None:
    store = WeightStore(tmp_path / "store")
    version = publish_tiny_version(store)
    store.update(version, status="rejected", reason="planted")
    app = web.Application()
    add_control_routes(app, ControlPlane(store, AcceptanceLog()))
    async with TestClient(TestServer(app)) as client:
        missing = await client.get("/v1/versions/42")
        assert missing.status == 404 and (await missing.json())["error"]["type"] == "store_error"
        refused = await client.post("/v1/live", json={"version": version})
        assert refused.status == 409 and "rejected" in (await refused.json())["error"]["message"]
        malformed = await client.post("/v1/live", json={"version": "one"})
        assert malformed.status == 400 and "integer" in (await malformed.json())["error"]["message"]
        nothing_live = await client.post("/v1/rollback", json={})
        assert nothing_live.status == 409
