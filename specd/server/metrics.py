"""Prometheus metrics for a specd server, named after vLLM's spec-decode metrics.

Contract: `ServingMetrics` owns its own registry (tests make their own), is updated from the
engine thread with plain counter increments (`observe_verification`, `observe_request`), and
derives acceptance rate and accept length per drafter version at scrape time from the counters.
It keeps `AcceptanceCounts` per (version, domain), from which `reports` builds what the learner's
canary reads.
Names (the `specd_` twins of vLLM's `vllm:spec_decode_*`):
  specd_spec_decode_num_draft_tokens_total{version}       drafts proposed
  specd_spec_decode_num_accepted_tokens_total{version}    drafts accepted
  specd_spec_decode_num_accepted_tokens_per_pos_total{position}
  specd_spec_decode_num_verification_passes_total{version}
  specd_spec_decode_num_emitted_tokens_total{version}
  specd_spec_decode_acceptance_rate{version}, specd_spec_decode_accept_length{version}  (gauges)
  specd_drafter_swaps_total, specd_drafter_refused_total
  specd_records_published_total, specd_records_shed_total
  specd_request_latency_seconds, specd_inter_token_latency_seconds (histograms)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specd.records import AcceptanceCounts, AcceptanceReport

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class _DerivedRates(Collector):
    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rate = GaugeMetricFamily("specd_spec_decode_acceptance_rate", "accepted / proposed drafts",
                                 labels=["version"])
        length = GaugeMetricFamily("specd_spec_decode_accept_length", "tokens emitted per target pass",
                                   labels=["version"])
        by_version: dict[str, AcceptanceCounts] = {}
        for (version, _), counts in list(self.metrics.totals.items()):
            by_version.setdefault(version, AcceptanceCounts()).add(counts)
        for version, summed in by_version.items():
            if summed.acceptance_rate is not None:
                rate.add_metric([version], summed.acceptance_rate)
            if summed.accept_length is not None:
                length.add_metric([version], summed.accept_length)
        yield rate
        yield length
        for name, help_text in (("specd_drafter_swaps", "drafter versions taken over"),
                                ("specd_drafter_refused", "drafter versions refused by verification"),
                                ("specd_records_shed", "trajectory records shed by a full bus")):
            source = self.metrics.sources.get(name)
            if source is not None:
                yield CounterMetricFamily(name, help_text, value=source())


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.draft_tokens = Counter("specd_spec_decode_num_draft_tokens", "drafts proposed", ["version"], registry=r)
        self.accepted_tokens = Counter("specd_spec_decode_num_accepted_tokens", "drafts accepted", ["version"],
                                       registry=r)
        self.accepted_per_pos = Counter("specd_spec_decode_num_accepted_tokens_per_pos",
                                        "drafts accepted at each draft position", ["position"], registry=r)
        self.passes = Counter("specd_spec_decode_num_verification_passes", "target verification passes",
                              ["version"], registry=r)
        self.emitted = Counter("specd_spec_decode_num_emitted_tokens", "tokens emitted", ["version"], registry=r)
        self.records_published = Counter("specd_records_published", "trajectory records published", registry=r)
        # counts owned by other objects (drafter, swapper, bus), read at scrape time
        self.sources: dict[str, Callable[[], float]] = {}
        self.request_latency = Histogram("specd_request_latency_seconds", "request latency", registry=r,
                                         buckets=LATENCY_BUCKETS)
        self.inter_token_latency = Histogram("specd_inter_token_latency_seconds",
                                             "time between streamed tokens", registry=r, buckets=ITL_BUCKETS)
        # (version, domain) -> counts: what reports to the learner carry
        self.totals: dict[tuple[str, str], AcceptanceCounts] = {}
        r.register(_DerivedRates(self))

    def observe_verification(self, version: str, drafts: int, accepted: int, emitted: int,
                             domain: str = "default") -> None:
        self.draft_tokens.labels(version).inc(drafts)
        self.accepted_tokens.labels(version).inc(accepted)
        self.passes.labels(version).inc()
        self.emitted.labels(version).inc(emitted)
        for position in range(accepted):
            self.accepted_per_pos.labels(str(position)).inc()
        self.totals.setdefault((version, domain), AcceptanceCounts()).add(
            AcceptanceCounts(drafts, accepted, 1, emitted))

    def record_published(self) -> None:
        self.records_published.inc()

    def reports(self, server_id: str) -> list[AcceptanceReport]:
        """One cumulative report per traffic domain: counts per drafter version."""
        by_domain: dict[str, dict[str, AcceptanceCounts]] = {}
        for (version, domain), counts in list(self.totals.items()):
            by_domain.setdefault(domain, {})[version] = replace(counts)  # a snapshot
        now = time.time()
        return [AcceptanceReport(server_id, now, domain, versions) for domain, versions in by_domain.items()]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
