"""The CLI checks what it will write and read before it loads a model: output paths that could not
be written at the end, input files that are not what they claim, addresses that do not resolve."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specd.cli.main import main
from specd.core.errors import ConfigurationError, TrafficError


def _refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("specd: error:") and "Traceback" not in err
    return err


def test_pretrain_refuses_an_out_that_its_manifest_would_overwrite_or_a_folder(tmp_path, capsys) -> None:
    work = str(tmp_path / "work")
    assert "manifest" in _refused(["pretrain", "--out", str(tmp_path / "x.json"), "--work", work], capsys)
    assert "is a folder" in _refused(["pretrain", "--out", str(tmp_path), "--work", work], capsys)
    a_file = tmp_path / "f"
    a_file.write_text("")
    assert "is a file" in _refused(["pretrain", "--out", str(tmp_path / "o.safetensors"), "--work", str(a_file)],
                                   capsys)
    assert not (tmp_path / "work").exists()  # refused before the work folder was claimed


def test_demo_refuses_output_paths_it_could_not_write_before_it_decodes(tmp_path, capsys) -> None:
    assert "is a folder" in _refused(["demo", "--json-out", str(tmp_path)], capsys)
    assert "the suffix picks the format" in _refused(["demo", "--json-out", str(tmp_path / "d.json"),
                                                      "--plot-out", str(tmp_path / "d.xyz")], capsys)


def test_a_traffic_file_that_is_not_utf8_is_a_clear_error(tmp_path) -> None:
    from specd.core.traffic import load_jsonl

    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(TrafficError, match="not UTF-8"):
        load_jsonl(path)


def test_missing_tls_files_are_refused_up_front(tmp_path) -> None:
    import argparse

    from specd.cli.service import _mqtt_settings

    args = argparse.Namespace(broker="mqtts://127.0.0.1:8883", deployment="d", tls_ca=str(tmp_path / "ca.pem"),
                              tls_cert=None, tls_key=None)
    with pytest.raises(ConfigurationError, match=r"--tls-ca .*no such file"):
        _mqtt_settings(args)


def test_a_host_that_does_not_resolve_is_a_clear_error() -> None:
    from aiohttp import web

    from specd.cli.service import listen

    with pytest.raises(ConfigurationError, match=r"cannot listen on not\.a\.host\.invalid:0"):
        listen(web.Application(), "not.a.host.invalid", 0)


def test_ctrl_c_ends_the_command_with_status_130_and_no_traceback(capsys, monkeypatch) -> None:
    import specd.cli.generate as generate

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run_generate", interrupted)
    assert main(["generate", "--prompt", "hi"]) == 130
    assert capsys.readouterr().err == "specd: interrupted\n"


def test_sigterm_ends_the_command_as_ctrl_c_does_with_status_143(capsys, monkeypatch) -> None:
    import specd.cli.generate as generate
    from specd.cli.main import Terminated

    def terminated(args):
        raise Terminated   # what the SIGTERM handler raises in the command's main thread

    monkeypatch.setattr(generate, "run_generate", terminated)
    assert main(["generate", "--prompt", "hi"]) == 143
    assert capsys.readouterr().err == "specd: terminated\n"


def test_flags_that_contradict_each_other_are_refused_before_anything_loads(tmp_path, capsys) -> None:
    assert "--adaptive-k goes with -k" in _refused(["demo", "--adaptive-k", "--json-out", str(tmp_path / "d.json")],
                                                   capsys)
    assert "give one of them" in _refused(["serve", "--no-learner", "--learner-mode", "process"], capsys)
    assert "the learner's" in _refused(["serve", "--broker", "mqtt://127.0.0.1:1", "--token", "t"], capsys)


def test_ctrl_c_while_the_subcommands_load_is_caught_too() -> None:
    """The entry point's own imports load nothing slow: torch and the subcommands load inside
    `main`, where Ctrl+C ends the command with one line (it took 1-2 s at module level, uncaught)."""
    import subprocess
    import sys

    loaded = subprocess.run([sys.executable, "-c", "import sys, specd.cli.main; print('torch' in sys.modules)"],
                            capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"


def test_a_reader_that_goes_away_ends_the_command_quietly_with_status_141(tmp_path, monkeypatch, capsys) -> None:
    import os
    import sys

    from specd.hotswap.store import WeightStore

    WeightStore(tmp_path / "store")
    read_end, write_end = os.pipe()
    os.close(read_end)  # `specd versions | head -1` once head has exited
    with open(write_end, "w", buffering=1) as closed_pipe:
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        assert main(["versions", "--store", str(tmp_path / "store")]) == 141
    assert "Traceback" not in capsys.readouterr().err


def test_vllm_refuses_flags_it_would_ignore_and_prints_the_store_as_an_absolute_path(tmp_path, capsys,
                                                                                       monkeypatch) -> None:
    store = ["--store", "/tmp/store"]
    assert "eagle3 route" in _refused(["vllm", "--print", *store, "--route", "custom", "--drafter-dir", "x"], capsys)
    assert "no such folder" in _refused(["vllm", "--print", *store, "--drafter-dir", str(tmp_path / "x")], capsys)
    assert "goes with --print" in _refused(["vllm", *store, "--json"], capsys)
    assert "in two ranges" in _refused(["vllm", "--print", *store, "--route", "custom", "--drafts-per-batch",
                                        "1-2:4,2-8:2"], capsys)
    (tmp_path / "empty").mkdir()
    assert "not a folder specd exported" in _refused(["vllm", "--print", *store, "--drafter-dir",
                                                       str(tmp_path / "empty")], capsys)
    assert "no config.json" in _refused(["vllm", "--print", *store, "--route", "custom", "--target",
                                         str(tmp_path / "empty")], capsys)
    monkeypatch.setenv("VLLM_PLUGINS", "someone_else")
    assert "leaves out specd" in _refused(["vllm", "--print", *store], capsys)
    monkeypatch.delenv("VLLM_PLUGINS")
    monkeypatch.chdir(tmp_path)
    assert main(["vllm", "--print", "--json", "--store", "st", "--route", "custom"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["env"]["SPECD_STORE"] == os.path.join(str(tmp_path), "st")
    assert not (tmp_path / "st").exists()  # printing a command makes no store
    # settings no flag names are passed on from the environment; those a flag decides are the flag's
    for name, value in (("SPECD_CONFIDENCE", "1"), ("SPECD_DRAFTER_GEMM", "native"), ("SPECD_BROKER", "mqtt://x")):
        monkeypatch.setenv(name, value)
    assert main(["vllm", "--print", "--json", "--store", "st", "--route", "custom"]) == 0
    env = json.loads(capsys.readouterr().out)["env"]
    assert env["SPECD_CONFIDENCE"] == "1" and env["SPECD_DRAFTER_GEMM"] == "native" and "SPECD_BROKER" not in env
    monkeypatch.setenv("SPECD_EAGLE_MIN_CHANCE", "abc")  # refused here, not in vLLM's worker
    assert "SPECD_EAGLE_MIN_CHANCE" in _refused(["vllm", "--print", "--store", "st", "--route", "custom"], capsys)


def test_serve_finds_a_taken_port_before_it_loads_a_model(capsys) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the default target and learner would take seconds to start: the refusal comes first
        assert "in use" in _refused(["serve", "--port", str(port), "--no-learner"], capsys)
        assert "in use" in _refused(["learner", "--store", "s", "--broker", "mqtt://127.0.0.1:1", "--port",
                                     str(port)], capsys)


def test_demo_refuses_a_store_an_earlier_run_left_before_it_loads_a_model(tmp_path, capsys) -> None:
    (tmp_path / "versions" / "000001").mkdir(parents=True)
    assert "already holds" in _refused(["demo", "--store", str(tmp_path), "--json-out", str(tmp_path / "d.json")],
                                       capsys)


def test_generate_drafts_with_the_shipped_drafter_unless_told_otherwise(monkeypatch) -> None:
    import argparse

    import specd.cli.generate as generate

    chosen: list[str] = []

    def build(choice, *rest):
        chosen.append(choice)
        raise KeyboardInterrupt  # stop before decoding: only the choice is under test

    monkeypatch.setattr(generate, "_build_drafter", build)
    monkeypatch.setattr(generate.LoadedTarget, "load", lambda *a, **k: argparse.Namespace(encode=lambda *a, **k: []))
    for argv in (["generate", "--prompt", "hi"], ["generate", "--prompt", "hi", "--drafter", "none"]):
        assert main(argv) == 130
    assert chosen == ["shipped", "none"]


def test_demo_refuses_more_humaneval_requests_than_it_has_problems_besides_the_held_out(capsys) -> None:
    assert "at most 312" in _refused(["demo", "--requests", "313"], capsys)


def test_only_the_default_demos_humaneval_problems_are_held_out_from_the_settings_validation() -> None:
    from specd.core.traffic import DEMO_REQUESTS, default_held_out, default_shift_traffic, tuned_on

    default = default_shift_traffic(DEMO_REQUESTS) + default_held_out(DEMO_REQUESTS)
    assert tuned_on(default) == []
    reseeded = default_shift_traffic(DEMO_REQUESTS, seed=1) + default_held_out(DEMO_REQUESTS, seed=1)
    assert tuned_on(reseeded)  # another draw serves problems the learner's settings were chosen on


def test_generate_refuses_a_pretrained_file_whose_weights_are_not_the_ones_its_manifest_names(tmp_path,
                                                                                            capsys) -> None:
    import shutil

    from specd.drafter.pretrained import SHIPPED_DRAFTER

    copy = tmp_path / SHIPPED_DRAFTER.name
    shutil.copy(SHIPPED_DRAFTER, copy)
    shutil.copy(SHIPPED_DRAFTER.with_suffix(".json"), copy.with_suffix(".json"))
    data = bytearray(copy.read_bytes())
    data[-4096:] = bytes(4096)   # finite zeros over the last weights: only the digest can tell
    copy.write_bytes(bytes(data))
    assert main(["generate", "--prompt", "hi", "--max-tokens", "2", "--drafter", str(copy)]) == 2
    assert "sha256" in capsys.readouterr().err


def test_a_feature_drafter_reading_layers_the_target_lacks_is_refused_before_it_drafts() -> None:
    import dataclasses
    from pathlib import Path

    from specd.core.errors import CheckpointError
    from specd.drafter.feature_model import new_feature_drafter
    from specd.drafter.pretrained import check_fits_target
    from specd.testing import tiny_target

    target = tiny_target()
    model = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                torch.arange(16))
    check_fits_target(Path("fits.safetensors"), model, target)
    last = target.config.num_layers - 1
    model.config = dataclasses.replace(model.config, capture_layers=(0, last + 5))   # a layer past the target's
    with pytest.raises(CheckpointError, match="reading layers"):
        check_fits_target(Path("other.safetensors"), model, target)
