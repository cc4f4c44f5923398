"""The `specd` command line: JSON output and clear errors instead of tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specd.cli import main


def test_missing_target_folder_is_a_clear_error(capsys, tmp_path) -> None:
    code = main(["generate", "--prompt", "hi", "--target", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("specd: error:") and "config.json" in err and "Traceback" not in err


def test_bad_option_value_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "hi", "--dtype", "int3"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_json_reports_speculation_figures() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "specd.cli", "generate", "--prompt", "Name three colours.", "--chat",
         "--drafter", "replay", "-k", "4", "--max-tokens", "24", "--json"],
        capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout)
    assert set(result) >= {"text", "token_ids", "accept_length", "acceptance_rate", "target_passes", "tokens_per_s"}
    # 24 tokens, no EOS before them: every replayed draft is the target's own token, so all are accepted
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 24 and result["text"]
    assert result["acceptance_rate"] == 1.0
    assert result["accept_length"] == round(24 / result["target_passes"], 4)


@pytest.mark.slow
def test_generate_refuses_a_too_long_request(capsys) -> None:
    code = main(["generate", "--prompt", "hi", "--drafter", "none", "--max-tokens", "100000"])
    assert code == 2
    assert "context window" in capsys.readouterr().err
