"""The demo as a deployment in miniature: a learner process on cores of its own, fair modes, rounds.

On tiny stand-in targets: the learner runs in a process of its own pinned to cores that serving
does not use, and killing it mid-run leaves serving whole (every request answered, losslessly)
and the report says so; without learning, adaptive and static are the same run (outputs, k
choices, accept lengths); on a target with structure to learn, a version trained on the records
after the shift goes live within the records the gate's settings promise.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from specd.core.traffic import TrafficItem
from specd.demo.deployment import DemoConfig, run_demo
from specd.demo.report import plot
from specd.drafter.factory import DrafterSpec
from specd.learner.config import LearnerConfig
from specd.model.target import LoadedTarget
from specd.testing import ByteTokenizer, learnable_target, tiny_loaded_target

TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a learner of its own needs a second core")
FAST_LEARNER = LearnerConfig(publish_every_steps=1, publish_every_seconds=0.5, min_records=1, window=16,
                             holdout_every=2, gate_min_held_out=2, holdout_capacity=4, feature_window=64,
                             feature_learning_rate=3e-3)


def shifted_traffic(first: int = 4, second: int = 8) -> list[TrafficItem]:
    return ([TrafficItem(prompt=f"chat {i}: hello there", domain="chat") for i in range(first)]
            + [TrafficItem(prompt=f"def f{i}(x):\n    return", domain="code", max_tokens=12) for i in range(second)])


def demo_config(**fields: Any) -> DemoConfig:
    base: dict[str, Any] = {"max_tokens": 12, "max_batch": 2, "round_size": 2,
                            "drafter": DrafterSpec(head_vocab=200, pretrained=False), "learner": FAST_LEARNER}
    return DemoConfig(**{**base, **fields})


@TWO_CORES
def test_the_learner_runs_in_a_process_of_its_own_on_cores_serving_does_not_use(tmp_path: Path) -> None:
    affinity = os.sched_getaffinity(0)
    result = run_demo(tiny_loaded_target(), shifted_traffic(), demo_config(), tmp_path / "store")
    learner = result["learner"]
    assert learner["arrangement"] == "process" and learner["pid"] != os.getpid()
    assert set(learner["affinity"]) == set(learner["cores"]) and set(learner["cores"]) < affinity
    assert learner["steps"] > 0 and learner["cpu_seconds"] > 0 and learner["alive"] is False
    assert learner["exitcode"] == 0
    assert os.sched_getaffinity(0) == affinity  # serving's pinning ends with the demo
    assert result["lossless"] == {"adaptive": True, "static": True}
    by_domain = result["rounds"]["by_domain"]
    assert list(by_domain) == ["chat", "code"] and by_domain["code"]["rounds"] == 4
    assert set(by_domain["code"]["ratios"]["adaptive/none"]) == {"median", "min", "max"}
    plot(result, tmp_path / "demo.png")
    assert (tmp_path / "demo.png").stat().st_size > 1000


@TWO_CORES
def test_killing_the_learner_mid_run_leaves_serving_whole_and_the_demo_says_so(tmp_path: Path) -> None:
    def kill_after_the_first_round(number: int, running: dict[str, Any]) -> None:
        if number == 0:
            os.kill(running["learner"].pid, signal.SIGKILL)

    result = run_demo(tiny_loaded_target(), shifted_traffic(), demo_config(), tmp_path / "store",
                      after_round=kill_after_the_first_round)
    assert result["learner"]["alive"] is False and result["learner"]["exitcode"] == -signal.SIGKILL
    assert result["lossless"] == {"adaptive": True, "static": True}
    assert all(result["summary"][mode]["code"]["requests"] == 8 for mode in result["summary"])


def test_without_learning_adaptive_and_static_are_the_same_run(tmp_path: Path) -> None:
    result = run_demo(tiny_loaded_target(), shifted_traffic(), demo_config(learning=False), tmp_path / "store")
    assert result["learner"]["arrangement"] == "off"
    adaptive, static = result["requests"]["adaptive"], result["requests"]["static"]
    assert [r["accept_length"] for r in adaptive] == [r["accept_length"] for r in static]
    assert [r["drafts_proposed"] for r in adaptive] == [r["drafts_proposed"] for r in static]
    assert result["k_choices"]["adaptive"] == result["k_choices"]["static"]
    assert result["lossless"] == {"adaptive": True, "static": True}
    assert result["lookahead_costs"]["verify_seconds"].keys() == {0, 1, 2, 3, 4}


def test_the_demo_prints_its_table_from_a_real_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specd.cli.demo_command import print_demo

    result = run_demo(tiny_loaded_target(), shifted_traffic(), demo_config(learning=False), tmp_path / "store")
    print_demo(result)  # versions are numbers: the line naming them must still print
    out = capsys.readouterr().out
    assert f"versions serving after the shift: {result['static_version']}" in out and "lossless" in out
    # one domain: no shift to name
    chat_only = {mode: {"chat": rows["chat"]} for mode, rows in result["summary"].items()}
    print_demo({**result, "domains": ["chat"], "summary": chat_only,
                "rounds": {**result["rounds"], "by_domain": {"chat": result["rounds"]["by_domain"]["chat"]}}})
    out = capsys.readouterr().out
    assert f"versions serving: {result['static_version']}" in out and "shift" not in out


def test_each_version_of_the_curve_prints_the_gates_own_figures_beside_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specd.cli.demo_command import print_demo

    result = run_demo(tiny_loaded_target(), shifted_traffic(), demo_config(learning=False), tmp_path / "store")
    passed = {"version": 2, "passed": True, "candidate": 2.25, "live": 2.2, "bar": 2.1, "held_out_records": 6}
    refused = {"version": 3, "passed": False, "candidate": 2.05, "live": 2.1, "bar": 2.29, "held_out_records": 7}
    curve = [{"version": v, "status": s, "records_after_shift": 4 * v, "accept_length": 1.8 + v / 100}
             for v, s in ((1, "retired"), (2, "retired"), (3, "rejected"))]
    print_demo({**result, "adaptation": curve,
                "learner": {**result["learner"], "published": [passed], "stats": {"rejected": [refused]}}})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("version")]
    assert lines[0].endswith("held-out accept length 1.81")  # day 0 was never judged
    assert lines[1].endswith("; gate 2.25 against 2.20 on 6 held-out records")
    assert lines[2].endswith("; gate 2.05 against 2.29 on 7 held-out records")  # the bar, where it is higher


def test_prompts_longer_than_a_prefill_chunk_are_served_in_every_mode(tmp_path: Path) -> None:
    # the first steps of a round only prefill (48 prompt tokens a step): they run no decoding pass
    long_prompt = "tell me about this: " + "a long question, " * 12
    traffic = [TrafficItem(prompt=f"{i} {long_prompt}", domain="chat") for i in range(2)]
    result = run_demo(tiny_loaded_target(), traffic, demo_config(learning=False), tmp_path / "store")
    assert all(row["tokens"] == 12 for rows in result["requests"].values() for row in rows)
    assert result["lossless"] == {"adaptive": True, "static": True}
    for row in result["rounds"]["per_round"]:  # prefill steps take time outside the decoding passes
        assert all(0 < mode["decoding_seconds"] < mode["seconds"] for mode in row["modes"].values())


@TWO_CORES
def test_a_version_trained_after_the_shift_goes_live_within_the_records_the_gate_promises(tmp_path: Path) -> None:
    target = learnable_target(vocab_size=ByteTokenizer.vocab_size)
    loaded = LoadedTarget(Path("learnable"), target.float(), ByteTokenizer())
    traffic = shifted_traffic(first=2, second=12)
    held_out = [TrafficItem(prompt=f"def g{i}(y):\n    return", domain="code", max_tokens=12) for i in range(3)]

    def learner_keeps_up(number: int, running: dict[str, Any]) -> None:
        # a tiny target serves a round in milliseconds: the pace of real traffic is the learner's to keep
        # (steps, not seconds: a loaded CI machine trains as much per round as a quiet one)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            report = running["learner"].report()
            if report.get("records_in", 0) >= report["records_sent"] and report.get("steps", 0) >= 10 * (number + 1):
                break
            time.sleep(0.05)
        time.sleep(1.0)  # a publication is due every step and every 0.5 s

    result = run_demo(loaded, traffic, demo_config(), tmp_path / "store", held_out=held_out,
                      after_round=learner_keeps_up)
    live_after_shift = [p for p in result["adaptation"] if p["status"] == "live" or p["version"] in
                        {v for v in result["swaps"]["versions_live_after_shift"] if v is not None}]
    trained_on_code = [p for p in live_after_shift if p["records_after_shift"] > 0]
    assert trained_on_code, result["adaptation"]
    # the gate's evidence: gate_min_held_out records held out, one in holdout_every, a few rounds of slack
    # for the records in flight while the learner process starts and publishes
    promise = FAST_LEARNER.holdout_every * FAST_LEARNER.gate_min_held_out + 3 * 2
    assert min(p["records_after_shift"] for p in trained_on_code) <= promise
    day0 = result["adaptation"][0]["accept_length"]
    assert max(p["accept_length"] for p in trained_on_code) > day0


def test_the_demo_learner_trains_in_bfloat16_only_on_a_cpu_with_bfloat16_arithmetic(monkeypatch) -> None:
    import torch

    from specd.demo import deployment
    assert deployment.DEMO_LEARNER.precision == deployment.training_precision()
    cpus = ((True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32"))
    for avx512_bf16, amx, precision in cpus:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert deployment.training_precision() == precision


def test_the_calibration_prices_every_width_a_continuation_can_reach_and_never_a_wider_pass_cheaper() -> None:
    from specd.demo.deployment import calibration_samples
    from specd.drafter.factory import build_drafter, initial_model

    loaded = tiny_loaded_target()
    config = demo_config(drafter=DrafterSpec(head_vocab=200, pretrained=False, context_k=6))
    drafter = build_drafter(config.drafter, initial_model(loaded.model, config.drafter), version=1)
    prompts = [list(loaded.encode(item.prompt or "")) for item in shifted_traffic()]
    samples = calibration_samples(loaded, drafter, prompts, config)
    assert set(samples.samples) == set(range(7))   # k = 0..4 and the continuations' reach up to 6
    costs = samples.frozen_copy()
    assert costs.frozen and costs.measured_verify_seconds.keys() == costs.verify_seconds.keys()
    seconds = [costs.verify_seconds[k] for k in range(7)]
    assert seconds == sorted(seconds)
