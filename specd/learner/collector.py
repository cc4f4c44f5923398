"""Prometheus metrics of the learner and its weight store, read at scrape time.

Contract: `LearnerCollector(learner, store, refused_before)` is a prometheus_client collector that
reads the learner's counters and the store's manifests when scraped (nothing is updated from the learner's
thread, so a scrape never races it beyond reading integers). The learner sidecar serves it on
its own `/metrics`; an embedded `specd serve` registers it beside the serving metrics.
Names:
  specd_learner_records_received_total      records taken from the bus (held out or trained on)
  specd_learner_records_refused_total       records (and messages) refused at validation: the learner's
                                            and `refused_before`'s (a sidecar's, before its spool)
  specd_learner_steps_total                 training steps
  specd_learner_tokens_trained_total        tokens trained on
  specd_learner_versions_published_total    candidates that passed the gate and went live
  specd_learner_versions_rejected_total     candidates the gate refused
  specd_learner_loop_failures_total         exceptions caught in the learner's loop
  specd_learner_record_age_seconds          learner lag: mean age of the last trained batch
  specd_learner_versions_behind             learner lag: drafter versions between the batch's records and live
  specd_learner_records_missing             records servers numbered that never arrived (a sidecar's `missing`)
  specd_learner_rank_{records_received,steps,status_age_seconds}{rank}   with ranks, on rank 0: every rank's
  specd_live_version                        the store's live version number
  specd_rollbacks_total                     versions rolled back (by an operator or the canary)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from specd.hotswap.store import WeightStore
    from specd.learner.learner import LearnerHandle


class LearnerCollector(Collector):
    def __init__(self, learner: LearnerHandle, store: WeightStore,
                 refused_before: Callable[[], Mapping[str, int]] | None = None,
                 missing: Callable[[], int] | None = None,
                 ranks: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.learner = learner
        self.store = store
        self.refused_before = refused_before
        self.missing = missing
        self.ranks = ranks

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.learner.stats
        before = self.refused_before() if self.refused_before is not None else {}
        refused = sum(dict(stats.refused).values()) + sum(before.values())
        counters = [
            ("specd_learner_records_received", "records taken from the bus", stats.records_in),
            ("specd_learner_records_refused", "records refused at validation", refused),
            ("specd_learner_steps", "training steps", stats.steps),
            ("specd_learner_tokens_trained", "tokens trained on", stats.tokens_trained),
            ("specd_learner_versions_published", "candidates that passed the gate", len(stats.published)),
            ("specd_learner_versions_rejected", "candidates the gate refused", len(stats.rejected)),
            ("specd_learner_loop_failures", "exceptions caught in the learner loop", stats.loop_failures),
            ("specd_rollbacks", "rollbacks by an operator or the canary",
             int(self.store.live_state().get("rollbacks", 0))),
        ]
        for name, help_text, count in counters:
            yield CounterMetricFamily(name, help_text, value=float(count))
        staleness = self.learner.staleness
        for name, help_text, key in (
                ("specd_learner_record_age_seconds", "mean age of the last trained batch's records",
                 "mean_record_age_s"),
                ("specd_learner_versions_behind", "drafter versions between the last batch's records and live",
                 "mean_versions_behind")):
            value = staleness.get(key)  # NaN until the learner has trained: unknown, not zero
            yield GaugeMetricFamily(name, help_text, value=math.nan if value is None else float(value))
        if self.missing is not None:
            yield GaugeMetricFamily("specd_learner_records_missing",
                                    "records servers numbered that never reached the learner", value=self.missing())
        if self.ranks is not None:
            yield from _rank_gauges(self.ranks())
        live = self.store.live_version()
        if live is not None:
            yield GaugeMetricFamily("specd_live_version", "the store's live drafter version", value=float(live))


RANK_GAUGES = (("records_received", "records this rank received (its spool's count)", "records_in"),
               ("steps", "training steps this rank took part in", "steps"),
               ("status_age_seconds", "seconds since this rank last wrote its status (grows while it is stopped)",
                "age_s"))


def _rank_gauges(statuses: list[dict[str, Any]]) -> Iterator[GaugeMetricFamily]:
    """specd_learner_rank_*{rank}: rank 0's counters above are its own; these are every rank's, from
    their status files (gauges: a file is as of its last write)."""
    for short, help_text, key in RANK_GAUGES:
        family = GaugeMetricFamily(f"specd_learner_rank_{short}", help_text, labels=["rank"])
        for status in statuses:
            if isinstance(status.get(key), int | float):
                family.add_metric([str(status.get("rank"))], float(status[key]))
        yield family
