"""`specd demo` on a tiny stand-in target: three modes, the shift, the summary, the plot."""

from __future__ import annotations

import json
from pathlib import Path

from specd.core.traffic import TrafficItem, load_jsonl
from specd.demo.deployment import MODES, DemoConfig, run_demo
from specd.demo.report import plot
from specd.drafter.factory import DrafterSpec
from specd.learner.config import LearnerConfig
from specd.testing import tiny_loaded_target


def test_demo_replays_traffic_in_three_modes_losslessly(tmp_path: Path) -> None:
    traffic = tmp_path / "traffic.jsonl"
    lines = [{"prompt": f"chat number {i}: hello", "domain": "chat"} for i in range(3)]
    lines += [{"messages": [{"role": "user", "content": f"def f{i}(x): return x"}], "domain": "code",
               "max_tokens": 6} for i in range(3)]
    traffic.write_text("\n".join(json.dumps(line) for line in lines))
    items = load_jsonl(traffic)
    assert [i.domain for i in items] == ["chat"] * 3 + ["code"] * 3 and isinstance(items[3], TrafficItem)
    config = DemoConfig(max_tokens=10, max_batch=2, drafter=DrafterSpec(head_vocab=200),
                        learner=LearnerConfig(duty_cycle=1.0, publish_every_steps=1, min_records=1, window=16))
    result = run_demo(tiny_loaded_target(), items, config, tmp_path / "store")
    assert list(result["summary"]) == list(MODES)
    for mode in MODES:
        assert list(result["summary"][mode]) == ["chat", "code"]
        assert result["summary"][mode]["code"]["requests"] == 3
    assert result["lossless"] == {"adaptive": True, "static": True}
    assert (tmp_path / "store" / "versions").is_dir() and result["static_version"] is not None
    plot(result, tmp_path / "demo.png")
    assert (tmp_path / "demo.png").stat().st_size > 1000


def test_a_request_over_the_context_window_is_named_with_the_max_tokens_the_user_gave(tmp_path: Path) -> None:
    import pytest

    from specd.core.errors import ConfigurationError

    loaded = tiny_loaded_target()
    window = loaded.model.config.max_position
    items = [TrafficItem(prompt="hi", domain="chat"), TrafficItem(prompt="x" * (window - 8), domain="chat")]
    config = DemoConfig(max_tokens=10, max_batch=2, drafter=DrafterSpec(head_vocab=200))
    with pytest.raises(ConfigurationError, match=r"request 2 of the traffic: .* \+ --max-tokens 10 exceeds"):
        run_demo(loaded, items, config, tmp_path / "store")
