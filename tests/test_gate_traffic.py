"""The gate judges the traffic a candidate is about to serve: domains weigh by their recent share."""

from __future__ import annotations

import pytest
import torch

from specd.core.errors import ConfigurationError
from specd.core.records import TrajectoryRecord
from specd.learner.config import LearnerConfig
from specd.learner.gate import Gate

OLD, NEW = "chat", "code"


def record(index: int, domain: str) -> TrajectoryRecord:
    return TrajectoryRecord(f"r{index}", "server", [1, 2, 3], [4, 5, 6, 7], [], 0.0, 1.0, 0.0, 0.0, domain)


class Models:
    """Live knows the old domain; the candidate lost a little of it and learned the new one."""

    def __init__(self) -> None:
        self.live, self.candidate = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        self.skill = {id(self.live): {OLD: 2.2, NEW: 1.7}, id(self.candidate): {OLD: 1.95, NEW: 2.1}}
        self.replays: list[tuple[int, tuple[str | None, ...]]] = []

    def accept_length(self, model, records: list[TrajectoryRecord]) -> float:
        """The token-weighted mean over `records`, as a replay of a whole set is."""
        self.replays.append((id(model), tuple(r.domain for r in records)))
        return sum(self.skill[id(model)][r.domain] for r in records) / len(records)


def fed(gate: Gate, domains: list[str]) -> Gate:
    for index, domain in enumerate(domains, start=1):
        gate.hold_out(record(index, domain), index)
    return gate


def test_after_a_shift_a_candidate_that_learned_the_new_domain_is_judged_on_it() -> None:
    traffic = [OLD] * 20 + [NEW] * 8   # held out every 4th: 5 old records, 2 new
    models = Models()
    weighted = fed(Gate(4, 16, 3, 0.05, traffic_window=8), traffic)
    verdict = weighted.verdict(models.candidate, models.live, models.accept_length)
    assert verdict["passed"] and verdict["improved"]
    assert verdict["domain_weights"] == {NEW: 1.0}
    assert verdict["candidate"] == pytest.approx(2.1) and verdict["live"] == pytest.approx(1.7)
    # the plain gate judges the same records as a mostly-old set and refuses the candidate
    plain = fed(Gate(4, 16, 3, 0.05), traffic).verdict(models.candidate, models.live, models.accept_length)
    assert not plain["passed"]
    assert plain["live"] == pytest.approx((5 * 2.2 + 2 * 1.7) / 7)


def test_while_the_mix_holds_each_domain_weighs_its_share_of_the_window() -> None:
    traffic = [OLD, NEW] * 12
    models = Models()
    verdict = fed(Gate(4, 16, 3, 0.05, traffic_window=8), traffic).verdict(
        models.candidate, models.live, models.accept_length)
    # every 4th record is the new domain: the held-out set is all new, the window half and half
    assert verdict["domain_weights"] == {NEW: 1.0}
    traffic = [OLD, OLD, NEW, NEW] * 6
    gate = fed(Gate(2, 16, 3, 0.05, traffic_window=8), traffic)
    verdict = gate.verdict(models.candidate, models.live, models.accept_length)
    assert verdict["domain_weights"] == {OLD: 0.5, NEW: 0.5}
    assert verdict["live"] == pytest.approx(0.5 * 2.2 + 0.5 * 1.7)
    # each domain is replayed apart, on its own records only
    assert {domains for _, domains in models.replays} == {(OLD,) * 6, (NEW,) * 6}


def test_held_out_domains_missing_from_the_window_weigh_alike() -> None:
    gate = fed(Gate(1, 16, 1, 0.05, traffic_window=1), [OLD, NEW, "other"])
    # the window holds only "other", which has no held-out record left once the set is narrowed
    shares = gate.domain_shares([r for r in gate.held_out if r.domain != "other"])
    assert {domain: weight for domain, (weight, _) in shares.items()} == {OLD: 0.5, NEW: 0.5}


def test_without_a_window_every_held_out_record_weighs_the_same() -> None:
    models = Models()
    gate = fed(Gate(1, 16, 3, 0.05), [OLD, OLD, NEW])
    verdict = gate.verdict(models.candidate, models.live, models.accept_length)
    assert verdict["live"] == pytest.approx((2 * 2.2 + 1.7) / 3)
    assert "domain_weights" not in verdict   # the manifest's verdict as before
    assert models.replays[0][1] == (OLD, OLD, NEW)


def test_a_negative_traffic_window_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="gate_traffic_window"):
        LearnerConfig(gate_traffic_window=-1)


def test_records_too_short_to_replay_are_never_held_out_so_no_domain_scores_zero() -> None:
    """A domain whose requests stop after a token or two (max_tokens 1-3) once weighed 0 tokens a
    pass into the verdict: gate figures below 1.0, and every other domain's difference shrunk."""
    gate = Gate(1, 16, 1, 0.05, traffic_window=8)
    short = TrajectoryRecord("short", "server", [1, 2, 3], [4], [], 0.0, 1.0, 0.0, 0.0, "terse")
    assert not gate.hold_out(short, 1)
    assert gate.hold_out(record(2, OLD), 2)
    models = Models()
    verdict = gate.verdict(models.candidate, models.live, models.accept_length)
    assert verdict["domain_weights"] == {OLD: 1.0} and verdict["live"] == pytest.approx(2.2)
