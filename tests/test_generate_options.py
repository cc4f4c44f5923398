"""`specd generate`'s options: an unknown device, an outsized k or a bad --top-p is refused before
anything loads; k is capped at --max-tokens; every numeric option's --help says what it does."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from test_target_bad_files import save_tiny_llama, save_tiny_tokenizer

from specd.cli.generate import MAX_DRAFTS
from specd.cli.main import build_parser, main
from specd.core.errors import ConfigurationError
from specd.model.target import check_device


@pytest.mark.parametrize("device", ["tpu", "", "cuda:x", "mps", "meta"])
def test_an_unknown_device_is_refused_in_one_line_before_anything_loads(device: str, tmp_path: Path, capsys) -> None:
    # the target folder does not exist: the device is refused before the folder is looked at
    code = main(["generate", "--prompt", "hi", "--device", device, "--target", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("specd: error:") and err.count("\n") == 1 and "cpu, cuda or cuda:N" in err


def test_cpu_devices_are_accepted() -> None:
    check_device("cpu")
    check_device("cpu:0")


def test_a_cuda_device_this_machine_lacks_is_refused(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_device("cuda:0")
    with pytest.raises(ConfigurationError, match="only 1 CUDA device"):
        check_device("cuda:1")


def test_k_above_the_maximum_is_refused_at_parse_time(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "hi", "--max-tokens", "4", "-k", "9000"])
    assert exit_info.value.code == 2
    assert f"argument -k: must be at most {MAX_DRAFTS}, got 9000" in capsys.readouterr().err
    assert build_parser().parse_args(["generate", "--prompt", "hi", "-k", str(MAX_DRAFTS)]).k == MAX_DRAFTS


def test_k_is_capped_at_max_tokens(tmp_path: Path, capsys) -> None:
    save_tiny_llama(tmp_path)
    save_tiny_tokenizer(tmp_path)
    code = main(["generate", "--prompt", "hi", "--target", str(tmp_path), "-k", str(MAX_DRAFTS),
                 "--max-tokens", "3", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["k"] == 3 and len(result["token_ids"]) == 3


def test_a_bad_top_p_is_refused_before_the_target_loads(tmp_path: Path, capsys) -> None:
    code = main(["generate", "--prompt", "hi", "--top-p", "2", "--target", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert code == 2 and "top_p must be in (0, 1]" in err and "config.json" not in err


def _generate_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices["generate"].format_help().split())


def test_help_describes_top_p_max_tokens_seed_and_k_with_their_defaults() -> None:
    text = _generate_help()
    assert "--top-p TOP_P nucleus sampling" in text and "(default: 1.0" in text
    assert "--max-tokens MAX_TOKENS most tokens to generate (default: 128)" in text
    assert "--seed SEED seed for sampling" in text and "(default: none" in text
    assert f"most drafts a step, 0 to {MAX_DRAFTS}, capped at --max-tokens" in text and "(default: 4)" in text
