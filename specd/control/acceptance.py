"""Live acceptance from the servers' reports: what the dashboard, `/v1/acceptance` and operators see.

Contract: servers report cumulative counters per traffic domain (drafts proposed and accepted,
target passes, tokens emitted), per drafter version of the learned drafter's own drafts and per
drafting source kind. `AcceptanceLog.add` turns them into per-interval deltas per server and
version or source (a restarted server's counters start again at zero: a drop is a reset, not a
negative delta), keeps bounded time series for the dashboard, and totals per version and source.
Everything it keeps is bounded, whatever reports name: the last counts of at most `MAX_TRACKED`
(server, domain, version or source) keys (the longest unreported go first), totals of the newest
`MAX_VERSIONS` versions and of the `MAX_SOURCES` most drafted sources.
These figures are what was served, on whatever traffic each version met; rollback decisions do not
read them (two versions that served different traffic are not comparable), the learner's canary
compares versions on the same records instead (`specd.learner.shadow`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, TypeVar

from specd.core.records import AcceptanceCounts, AcceptanceReport, validate_report

Name = TypeVar("Name", int, str)   # a version number or a source name

MAX_TRACKED = 10_000   # (server, domain, version or source) keys whose last counts are kept
MAX_VERSIONS = 1_000   # versions with totals (the newest)
MAX_SOURCES = 64       # sources with totals (the most drafted)


class AcceptanceLog:
    """Per-version acceptance (the learned drafter's own drafts) and
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
        self._last.pop(key, None)
        self._last[key] = counts  # re-inserted: the dict's order is the order keys were last reported
        if len(self._last) > MAX_TRACKED:
            del self._last[next(iter(self._last))]
        if not delta.is_empty:
            totals.setdefault(name, AcceptanceCounts()).add(delta)
            self._bound(totals)
            series.append({"time": at, "server": report.server_id, field: name, "domain": report.domain,
                           **delta.as_dict()})

    def _bound(self, totals: dict[Name, AcceptanceCounts]) -> None:
        if totals is self.totals and len(totals) > MAX_VERSIONS:
            del totals[min(totals)]
        elif totals is self.source_totals and len(totals) > MAX_SOURCES:
            del totals[min(totals, key=lambda source: totals[source].drafts)]

    def acceptance(self, version: int) -> tuple[float | None, int]:
        total = self.totals.get(version)
        if total is None:
            return None, 0
        return total.acceptance_rate, total.drafts

    def totals_as_dict(self) -> dict[str, dict[str, int]]:
        return {str(version): counts.as_dict() for version, counts in self.totals.items()}

    def source_totals_as_dict(self) -> dict[str, dict[str, int]]:
        return {source: counts.as_dict() for source, counts in self.source_totals.items()}
