"""The `specd` command line: JSON output and clear errors instead of tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from specd.cli.main import main
from specd.core.errors import ConfigurationError


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
        [sys.executable, "-m", "specd.cli.main", "generate", "--prompt", "Name three colours.", "--chat",
         "--drafter", "replay", "-k", "4", "--max-tokens", "24", "--json"],
        capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout)
    assert set(result) >= {"text", "token_ids", "accept_length", "acceptance_rate", "target_passes", "tokens_per_s"}
    # 24 tokens, no EOS before them: every replayed draft is the target's own token, so all are accepted
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 24 and result["text"]
    assert result["acceptance_rate"] == 1.0
    assert result["accept_length"] == round(24 / result["target_passes"], 4)
    # k is a cap: the report says how many drafts each target pass verified
    assert sum(result["drafts_per_step"].values()) == result["target_passes"]
    assert all(0 <= int(k) <= result["k"] for k in result["drafts_per_step"])


@pytest.mark.slow
def test_generate_refuses_a_too_long_request(capsys) -> None:
    code = main(["generate", "--prompt", "hi", "--drafter", "none", "--max-tokens", "100000"])
    assert code == 2
    assert "context window" in capsys.readouterr().err


def test_pretrain_flags_override_the_recipe_and_nothing_else() -> None:
    from specd.cli.main import build_parser
    from specd.cli.pretrain_command import pretrain_config
    from specd.offline.pretrain import RECIPES, PretrainConfig

    def config(*flags: str) -> PretrainConfig:
        return pretrain_config(build_parser().parse_args(["pretrain", "--out", "o", "--work", "w", *flags]))

    assert config("--recipe", "shipped") == RECIPES["shipped"]
    assert config("--recipe", "shipped", "--data", "sharegpt", "--draft-vocab", "16384") == replace(
        RECIPES["shipped"], data="sharegpt", draft_vocab=16384)
    assert config("--max-seconds", "60") == replace(PretrainConfig(), max_seconds=60.0)
    shipped = RECIPES["shipped"]
    assert config("--recipe", "shipped", "--drafter-layers", "2", "--greedy-only", "--distill-rounds", "2") == replace(
        shipped, drafter_layers=2, greedy_only=True, distill=replace(shipped.distill, rounds=2))
    # the second stage's recipe is the first's with the flags the shipped file's second stage was run with
    assert config("--recipe", "shipped", "--distill-rounds", "2", "--first-round", "1", "--distill-sample", "2112",
                  "--steps", "1500", "--lr", "6e-5", "--keep", "best") == RECIPES["shipped-2"]
    assert config("--recipe", "shipped", "--distill-rounds", "3", "--first-round", "2", "--steps", "3000",
                  "--lr", "6e-5", "--keep", "best") == RECIPES["shipped-3"]
    with pytest.raises(ConfigurationError, match="learning rate"):  # what the flag's own check cannot see
        args = build_parser().parse_args(["pretrain", "--out", "o", "--work", "w"])
        args.lr = float("nan")
        pretrain_config(args)
    with pytest.raises(ConfigurationError, match="rounds"):
        config("--distill-rounds", "2", "--first-round", "2")


def test_init_and_init_from_together_are_refused(tmp_path, capsys) -> None:
    code = main(["pretrain", "--init", "target_layer", "--init-from", str(tmp_path / "d.safetensors"),
                 "--out", str(tmp_path / "e.safetensors"), "--work", str(tmp_path / "work")])
    assert code == 2 and "give one of them" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["shipped-2", "shipped-3"])
def test_a_later_stage_recipe_without_the_file_it_continues_is_refused(recipe, tmp_path, capsys) -> None:
    code = main(["pretrain", "--recipe", recipe, "--out", str(tmp_path / "d.safetensors"),
                 "--work", str(tmp_path / "work")])
    assert code == 2
    assert "--init-from" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("argv", [
    ["demo", "-k", "-3"], ["demo", "-k", "0"], ["demo", "--max-tokens", "0"], ["demo", "--batch", "0"],
    ["demo", "--requests", "1"], ["demo", "--round-size", "x"], ["generate", "--prompt", "hi", "-k", "-1"],
    ["generate", "--prompt", "hi", "--max-tokens", "0"], ["serve", "--port", "70000"],
    ["learner", "--store", "s", "--port", "-2"], ["vllm", "--store", "s", "-k", "0"],
    ["pretrain", "--out", "o", "--work", "w", "--batch", "0"],
    ["pretrain", "--out", "o", "--work", "w", "--steps", "0"],
    ["pretrain", "--out", "o", "--work", "w", "--first-round", "-1"], ["serve", "--max-context", "1"],
    ["pretrain", "--out", "o", "--work", "w", "--lr", "inf"], ["pretrain", "--out", "o", "--work", "w", "--lr", "nan"],
    ["pretrain", "--out", "o", "--work", "w", "--prompt-weight", "nan"], ["serve", "--shutdown-grace", "-1"],
    ["pretrain", "--out", "o", "--max-length", "8"],
    ["serve", "--duty-cycle", "-3"], ["demo", "--duty-cycle", "1.5"],
    ["learner", "--store", "s", "--publish-every", "-1"],
    ["learner", "--store", "s", "--spool-max-mb", "-5"], ["learner", "--store", "s", "--dedup-window", "-1"],
    ["learner", "--store", "s", "--anchor-pull", "1"], ["learner", "--store", "s", "--anchor-pull", "-0.1"],
    ["learner", "--store", "s", "--gate-confidence", "-1"], ["learner", "--store", "s", "--gate-confidence", "inf"],
    ["learner", "--store", "s", "--gate-traffic-window", "-1"],
    ["vllm", "--store", "s", "--kv-cache-gib", "nan"]])
def test_impossible_numbers_are_refused_before_anything_loads(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "error: argument" in err and ("must be" in err or "whole number" in err) and "Traceback" not in err


def test_an_address_in_use_is_a_clear_error() -> None:
    import socket

    from aiohttp import web

    from specd.cli.service import listen

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match=f"cannot listen on 127.0.0.1:{port}: .*in use"):
            listen(web.Application(), "127.0.0.1", port)


def test_the_learner_refuses_context_k_which_only_servers_use(capsys) -> None:
    from specd.cli.main import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["learner", "--store", "s", "--broker", "mqtt://127.0.0.1:1883", "--context-k", "4"])
    assert exit_.value.code == 2 and "--context-k" in capsys.readouterr().err
    args = build_parser().parse_args(["learner", "--store", "s", "--broker", "mqtt://127.0.0.1:1883"])
    assert not hasattr(args, "context_k")


@pytest.mark.parametrize("argv, reach", [(["demo"], 8), (["demo", "-k", "3"], None),
                                          (["demo", "-k", "3", "--context-k", "6"], 6), (["serve"], 8),
                                          (["serve", "--context-k", "2"], 2)])
def test_continuations_reach_past_k_unless_the_demo_fixes_k(argv: list[str], reach: int | None) -> None:
    from specd.cli.demo_command import demo_drafter_spec
    from specd.cli.main import build_parser
    from specd.cli.service import drafter_spec

    args = build_parser().parse_args(argv)
    spec = demo_drafter_spec(args) if argv[0] == "demo" else drafter_spec(args)
    assert spec.context_k == reach


def test_pretrain_says_when_the_draft_vocabulary_asked_for_is_more_than_the_target_has(tmp_path, capsys,
                                                                                       monkeypatch) -> None:
    import specd.offline.pretrain as offline
    from specd.testing.processes import tiny_checkpoint

    checkpoint = tiny_checkpoint(tmp_path / "tiny")
    ran: list[int] = []

    def pretend(loaded, config, *_rest):   # the training itself is pretrain's own tests' business
        ran.append(config.draft_vocab)
        return {"held_out": {"accept_length": 1.0, "validation": {"accept_length": 1.0}, "k": 4},
                "steps": 0, "tokens_trained": 0}

    monkeypatch.setattr(offline, "pretrain", pretend)
    argv = ["pretrain", "--target", str(checkpoint), "--out", str(tmp_path / "d.safetensors"),
            "--work", str(tmp_path / "work"), "--data", "sharegpt"]
    assert main([*argv, "--draft-vocab", "100000"]) == 0 and ran == [100000]
    assert "--draft-vocab 100000 is more than the target's 49152 ids" in capsys.readouterr().err
    assert main(argv) == 0   # the recipe's own vocabulary: nothing to say
    assert "--draft-vocab" not in capsys.readouterr().err
