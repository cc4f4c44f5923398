"""Provenance: the commit, tree, versions and machine a measured figure came from, in benchmarks and the main job."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from specd.core.provenance import provenance, state_at_start


def test_provenance_names_the_commit_versions_and_settings_and_never_a_secret(monkeypatch) -> None:
    monkeypatch.setenv("SPECD_TOKEN", "do-not-print")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    info = provenance(state_at_start(), time.time(), {"k": 4, "path": Path("/tmp/x"), "run": print})
    assert info["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", info["git_commit"])
    assert info["versions"]["torch"] and info["cpu_count"] >= 1
    assert info["threads"]["OMP_NUM_THREADS"] == "2" and "SPECD_TOKEN" not in info["threads"]
    assert info["settings"]["k"] == 4 and info["settings"]["path"] == "/tmp/x"
    json.dumps(info)  # JSON-ready whatever the settings held


def test_the_main_jobs_json_carries_its_provenance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import specd.demo.deployment as deployment
    import specd.demo.report as report
    from specd.cli import demo_command
    from specd.cli.main import build_parser
    from specd.model.target import LoadedTarget

    # only the command's wiring is under test: the demo itself is test_demo's and test_demo_deployment's
    monkeypatch.setattr(LoadedTarget, "load", staticmethod(lambda target: None))
    monkeypatch.setattr(deployment, "run_demo", lambda *args, **kwargs: {"summary": {}})
    monkeypatch.setattr(report, "plot", lambda result, path: None)
    monkeypatch.setattr(demo_command, "print_demo", lambda result: None)
    out = tmp_path / "demo.json"
    args = build_parser().parse_args(["demo", "--traffic", str(_traffic(tmp_path)), "--json-out", str(out),
                                      "--plot-out", str(tmp_path / "demo.png")])
    assert demo_command.run_demo_command(args) == 0
    result = json.loads(out.read_text())
    assert result["summary"] == {} and result["provenance"]["settings"]["json_out"] == str(out)
    assert result["provenance"]["seconds"] >= 0 and "run" not in result["provenance"]["settings"]


def _traffic(folder: Path) -> Path:
    path = folder / "traffic.jsonl"
    path.write_text(json.dumps({"prompt": "hello", "domain": "chat"}) + "\n")
    return path
