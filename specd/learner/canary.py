"""Live acceptance from the servers' reports, and the canary that rolls a regression back.

Contract: servers report cumulative counters per drafter version and traffic domain (drafts
proposed and accepted, target passes, tokens emitted). `AcceptanceLog.add` turns them into per-interval deltas per
server and version (a restarted server's counters start again at zero: a drop is a reset, not a
negative delta), keeps a bounded time series for the dashboard, and totals per version.
`canary_verdict` compares the live version with the one before it: once the live version has
at least `min_drafts` drafted tokens, an acceptance rate below its predecessor's by more than
`margin` is a regression. A pinned live version is the floor and is never rolled back
automatically.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from specd.hotswap.store import WeightStore

COUNTERS = ("drafts", "accepted", "passes", "emitted")


@dataclass(frozen=True)
class CanaryConfig:
    margin: float = 0.10       # acceptance-rate points
    min_drafts: int = 400


class AcceptanceLog:
    def __init__(self, max_points: int = 5000) -> None:
        self.series: deque[dict[str, Any]] = deque(maxlen=max_points)
        self.totals: dict[str, dict[str, int]] = {}
        self._last: dict[tuple[str, str, str], dict[str, int]] = {}

    def add(self, report: dict[str, Any]) -> None:
        server = str(report.get("server_id", "?"))
        domain = str(report.get("domain") or "default")
        at = float(report.get("time", time.time()))
        versions = report.get("versions")
        if not isinstance(versions, dict):
            raise ValueError("a report needs a `versions` object")
        for version, counts in versions.items():
            if not isinstance(counts, dict) or not all(isinstance(counts.get(c, 0), int) for c in COUNTERS):
                raise ValueError(f"report for version {version!r} has malformed counters")
            previous = self._last.get((server, domain, version), dict.fromkeys(COUNTERS, 0))
            reset = any(counts.get(c, 0) < previous[c] for c in COUNTERS)
            delta = {c: counts.get(c, 0) - (0 if reset else previous[c]) for c in COUNTERS}
            self._last[(server, domain, version)] = {c: counts.get(c, 0) for c in COUNTERS}
            if not any(delta.values()):
                continue
            total = self.totals.setdefault(str(version), dict.fromkeys(COUNTERS, 0))
            for c in COUNTERS:
                total[c] += delta[c]
            self.series.append({"time": at, "server": server, "version": str(version), "domain": domain, **delta})

    def acceptance(self, version: str) -> tuple[float | None, int]:
        total = self.totals.get(version)
        if not total or not total["drafts"]:
            return None, 0
        return total["accepted"] / total["drafts"], total["drafts"]


def canary_verdict(log: AcceptanceLog, live: int, predecessor: int | None, live_pinned: bool,
                   config: CanaryConfig) -> dict[str, Any] | None:
    """Evidence for a rollback of `live`, or None when it stands."""
    if predecessor is None or live_pinned:
        return None
    ours, drafted = log.acceptance(str(live))
    theirs, their_drafts = log.acceptance(str(predecessor))
    if ours is None or theirs is None or drafted < config.min_drafts:
        return None
    if ours < theirs - config.margin:
        return {"by": "canary", "acceptance": ours, "drafts": drafted, "predecessor": predecessor,
                "predecessor_acceptance": theirs, "predecessor_drafts": their_drafts, "margin": config.margin,
                "time": time.time()}
    return None


def apply_canary(store: WeightStore, log: AcceptanceLog, config: CanaryConfig) -> dict[str, Any] | None:
    """Roll the live version back if the canary finds a regression; returns the evidence if it did."""
    live = store.live_version()
    if live is None:
        return None
    history = store.live_state()["history"]
    evidence = canary_verdict(log, live, history[-1] if history else None,
                              bool(store.manifest(live).get("pinned")), config)
    if evidence is not None:
        evidence["restored"] = store.rollback(None, evidence)
    return evidence
