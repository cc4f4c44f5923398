"""The gate with a confidence bound: a candidate passes on paired evidence, not on a point estimate."""

from __future__ import annotations

import math

import pytest
import torch

from specd.core.errors import ConfigurationError
from specd.core.records import TrajectoryRecord
from specd.learner.config import LearnerConfig
from specd.learner.gate import Gate


def record(index: int, domain: str = "chat") -> TrajectoryRecord:
    return TrajectoryRecord(f"r{index}", "server", [1, 2, 3], [4, 5, 6, 7], [], 0.0, 1.0, 0.0, 0.0, domain)


class Replays:
    """Accept lengths per model and record id, and every replay asked for."""

    def __init__(self, values: dict[int, dict[str, float]]) -> None:
        self.values = values
        self.calls: list[tuple[int, tuple[str, ...]]] = []

    def accept_length(self, model, records: list[TrajectoryRecord]) -> float:
        self.calls.append((id(model), tuple(r.record_id for r in records)))
        return sum(self.values[id(model)][r.record_id] for r in records) / len(records)


def gate_with(records: list[TrajectoryRecord], z: float, margin: float = 0.05, window: int = 0) -> Gate:
    gate = Gate(1, 64, 4, margin, traffic_window=window, confidence_z=z)
    for index, r in enumerate(records, start=1):
        gate.hold_out(r, index)
    return gate


def noisy_pair(count: int, shortfall: float, spread: float) -> tuple[torch.nn.Module, torch.nn.Module, Replays]:
    """Live at 2.2 on every record; the candidate `shortfall` worse on average, ± `spread` by record."""
    live, candidate = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    records = [record(i) for i in range(count)]
    replays = Replays({id(live): {r.record_id: 2.2 for r in records},
                       id(candidate): {r.record_id: 2.2 - shortfall + (spread if i % 2 else -spread)
                                       for i, r in enumerate(records)}})
    return live, candidate, replays


def test_a_candidate_a_little_worse_on_noisy_records_passes_the_margin_but_not_the_bound() -> None:
    live, candidate, replays = noisy_pair(8, shortfall=0.04, spread=0.3)
    records = [record(i) for i in range(8)]
    assert gate_with(records, z=0).verdict(candidate, live, replays.accept_length)["passed"]
    verdict = gate_with(records, z=1.0).verdict(candidate, live, replays.accept_length)
    assert not verdict["passed"]
    assert verdict["lower_bound"] < -0.05 and "lower bound" in verdict["reason"]
    assert math.isclose(verdict["difference"], -0.04, abs_tol=1e-9)


def test_a_candidate_the_records_agree_is_better_passes_and_becomes_the_bar() -> None:
    live, candidate, replays = noisy_pair(8, shortfall=-0.3, spread=0.05)
    verdict = gate_with([record(i) for i in range(8)], z=1.64).verdict(candidate, live, replays.accept_length)
    assert verdict["passed"] and verdict["improved"]
    assert verdict["candidate"] > verdict["live"]


def test_the_same_drafter_passes_with_no_spread_even_without_a_margin() -> None:
    live = torch.nn.Linear(2, 2)
    records = [record(i) for i in range(6)]
    replays = Replays({id(live): {r.record_id: 1.5 + 0.1 * i for i, r in enumerate(records)}})
    verdict = gate_with(records, z=2.0, margin=0.0).verdict(live, live, replays.accept_length)
    assert verdict["passed"] and verdict["lower_bound"] == 0.0 and verdict["improved"]


@pytest.mark.parametrize("bar_value", [2.4, 1.9])
def test_the_better_of_live_and_bar_is_the_reference(bar_value: float) -> None:
    live, bar, candidate = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    records = [record(i) for i in range(6)]
    replays = Replays({id(m): {r.record_id: v for r in records} for m, v in
                       ((live, 2.0), (bar, bar_value), (candidate, 2.1))})
    verdict = gate_with(records, z=1.0).verdict(candidate, live, replays.accept_length, bar=bar)
    if bar_value > 2.0:   # the bar is better than live: the candidate is 0.3 short of it
        assert not verdict["passed"] and "the bar" in verdict["reason"]
        assert math.isclose(verdict["difference"], -0.3, abs_tol=1e-9)
    else:                 # live is the reference: the candidate is 0.1 ahead
        assert verdict["passed"] and verdict["improved"]
        assert math.isclose(verdict["difference"], 0.1, abs_tol=1e-9)


def test_each_record_of_the_live_side_is_replayed_once_while_the_live_version_holds() -> None:
    live, candidate, replays = noisy_pair(10, shortfall=0.0, spread=0.1)
    records = [record(i) for i in range(10)]
    gate = gate_with(records[:8], z=1.0)
    gate.verdict(candidate, live, replays.accept_length)
    for index in (9, 10):
        gate.hold_out(records[index - 1], index)
    gate.verdict(candidate, live, replays.accept_length)
    live_replays = [ids for model, ids in replays.calls if model == id(live)]
    assert sorted(ids[0] for ids in live_replays) == sorted(r.record_id for r in records)
    assert all(len(ids) == 1 for ids in live_replays)  # one record at a time: the pairs need each alone


def test_domains_weigh_by_the_traffic_in_the_bound_too() -> None:
    live, candidate = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    records = [record(i, "chat") for i in range(4)] + [record(i, "code") for i in range(4, 8)]
    replays = Replays({id(live): {r.record_id: 2.0 for r in records},
                       id(candidate): {r.record_id: (1.8 if r.domain == "chat" else 2.5) + 0.01 * (i % 2)
                                       for i, r in enumerate(records)}})
    gate = gate_with(records, z=1.0, window=4)  # the newest four taken are all code
    verdict = gate.verdict(candidate, live, replays.accept_length)
    assert verdict["domain_weights"] == {"code": 1.0}
    assert verdict["passed"] and verdict["difference"] > 0.4


def test_the_learner_config_refuses_a_negative_or_endless_confidence() -> None:
    for z in (-1.0, math.inf, math.nan):
        with pytest.raises(ConfigurationError, match="gate_confidence_z"):
            LearnerConfig(gate_confidence_z=z)


@pytest.mark.parametrize("z", [0.0, 1.0])
def test_near_one_the_margin_shrinks_so_a_drafter_whose_drafts_all_fail_is_refused(z: float) -> None:
    """On a random target drafters accept about 1.04 tokens a pass; a version drowned in noise, 1.00.
    The fixed margin (0.05) passed it; the margin in proportion to what live drafts (0.0044) does not."""
    live, candidate = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    records = [record(i) for i in range(8)]
    replays = Replays({id(live): {r.record_id: 1.044 for r in records},
                       id(candidate): {r.record_id: 1.001 for r in records}})
    verdict = gate_with(records, z=z).verdict(candidate, live, replays.accept_length)
    assert not verdict["passed"]
    level = Replays({id(live): {r.record_id: 1.044 for r in records},
                     id(candidate): {r.record_id: 1.042 for r in records}})
    assert gate_with(records, z=z).verdict(candidate, live, level.accept_length)["passed"]


def test_at_the_accept_lengths_real_targets_give_the_margin_is_unchanged() -> None:
    gate = gate_with([], z=0)
    assert gate.margin_below(1.5) == gate.margin_below(2.4) == 0.05
    assert math.isclose(gate.margin_below(1.25), 0.025) and gate.margin_below(1.0) == 0.0
    assert gate_with([], z=0, margin=0.25).margin_below(2.0) == 0.25  # an operator's wider margin stands
