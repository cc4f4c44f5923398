"""The Prometheus view of supervised background loops, shared by the serving and learner processes.

Contract: `BackgroundCollector(health)` exports `specd_background_failures_total{task}` from a
`BackgroundHealth` (`specd.core.threads`) at scrape time; it holds no counts of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from specd.core.threads import BackgroundHealth


class BackgroundCollector(Collector):
    """specd_background_failures_total{task}: failures of supervised background loops (each restarted)."""

    def __init__(self, health: BackgroundHealth) -> None:
        self.health = health

    def collect(self) -> Iterator[CounterMetricFamily]:
        failures = CounterMetricFamily("specd_background_failures",
                                       "failures of supervised background loops (each restarted)", labels=["task"])
        for task, count in sorted(self.health.failures().items()):
            failures.add_metric([task], count)
        yield failures
