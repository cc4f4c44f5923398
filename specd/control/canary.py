"""Live acceptance from the servers' reports, and the canary that rolls a regression back.

Contract: servers report cumulative counters per traffic domain (drafts proposed and accepted,
target passes, tokens emitted), per drafter version of the learned drafter's own drafts and per
drafting source kind. `AcceptanceLog.add` turns them into per-interval deltas per server and
version or source (a restarted server's counters start again at zero: a drop is a reset, not a
negative delta), keeps bounded time series for the dashboard, and totals per version and source.
`canary_verdict` compares the live version with the one before it: once the live version has
at least `min_drafts` drafted tokens, an acceptance rate below its predecessor's by more than
`margin` is a regression. A pinned live version is the floor and is never rolled back
automatically. `apply_canary` rolls back only the version it judged: if the live version changed
while it looked, the rollback is not made (the store's compare-and-set).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, TypeVar

from specd.core.records import AcceptanceCounts, AcceptanceReport, validate_report
from specd.hotswap.store import LiveVersionChanged, WeightStore

Name = TypeVar("Name", int, str)   # a version number or a source name


@dataclass(frozen=True)
class CanaryConfig:
    margin: float = 0.10       # acceptance-rate points
    min_drafts: int = 400


class AcceptanceLog:
    """Per-version acceptance (the learned drafter's own drafts: what the canary judges) and
    per-source acceptance (what operators see beside it), as deltas and totals."""

    def __init__(self, max_points: int = 5000) -> None:
        self.series: deque[dict[str, Any]] = deque(maxlen=max_points)
        self.source_series: deque[dict[str, Any]] = deque(maxlen=max_points)
        self.totals: dict[int, AcceptanceCounts] = {}
        self.source_totals: dict[str, AcceptanceCounts] = {}
        self._last: dict[tuple[str, str, int | str], AcceptanceCounts] = {}

    def add(self, report: AcceptanceReport | dict[str, Any]) -> None:
        """Take one cumulative report (an untrusted dict is validated first: RecordRefused if malformed)."""
        if not isinstance(report, AcceptanceReport):
            report = validate_report(report)
        at = report.time or time.time()
        for version, counts in report.versions.items():
            self._take(report, at, "version", version, counts, self.totals, self.series)
        for source, counts in report.sources.items():
            self._take(report, at, "source", source, counts, self.source_totals, self.source_series)

    def _take(self, report: AcceptanceReport, at: float, field: str, name: Name, counts: AcceptanceCounts,
              totals: dict[Name, AcceptanceCounts], series: deque[dict[str, Any]]) -> None:
        """Add what `counts` adds to the last report of this server, domain and version (or source)."""
        key = (report.server_id, report.domain, name)  # an int for a version, a str for a source: apart
        previous = self._last.get(key, AcceptanceCounts())
        # a restarted server's counters start again at zero: then the whole count is new
        delta = counts.minus(previous) if counts.covers(previous) else counts
        self._last[key] = counts
        if not delta.is_empty:
            totals.setdefault(name, AcceptanceCounts()).add(delta)
            series.append({"time": at, "server": report.server_id, field: name, "domain": report.domain,
                           **delta.as_dict()})

    def acceptance(self, version: int) -> tuple[float | None, int]:
        total = self.totals.get(version)
        if total is None:
            return None, 0
        return total.acceptance_rate, total.drafts

    def totals_as_dict(self) -> dict[str, dict[str, int]]:
        return {str(version): counts.as_dict() for version, counts in self.totals.items()}

    def source_totals_as_dict(self) -> dict[str, dict[str, int]]:
        return {source: counts.as_dict() for source, counts in self.source_totals.items()}


def canary_verdict(log: AcceptanceLog, live: int, predecessor: int | None, live_pinned: bool,
                   config: CanaryConfig) -> dict[str, Any] | None:
    """Evidence for a rollback of `live`, or None when it stands."""
    if predecessor is None or live_pinned:
        return None
    ours, drafted = log.acceptance(live)
    theirs, their_drafts = log.acceptance(predecessor)
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
    if evidence is None:
        return None
    try:
        evidence["restored"] = store.rollback(None, evidence, if_live=live)
    except LiveVersionChanged:  # someone else changed the live version meanwhile: the evidence is about the old one
        return None
    return evidence
