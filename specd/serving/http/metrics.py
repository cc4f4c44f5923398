"""Prometheus metrics for a specd server, named after vLLM's spec-decode metrics.

Contract: `ServingMetrics` owns its own registry (tests make their own), is updated from the
engine thread with plain counter increments (`observe_verification`, `observe_request`), and
derives acceptance rate and accept length per drafter version and drafting source at scrape time
from the counters. `source` is the step's source kind (`core.records.source_kind`: "learned",
"context", "table", or "none" for a pass that verified no drafts), so the learned drafter's
figures count only its own drafts. It keeps `AcceptanceCounts` per (version, source, domain),
from which `reports` builds what the learner's canary reads (a version's counts: the learned
drafter's own steps). Scrapes and reports run on other threads than the engine: they read a
snapshot taken under the same lock the engine's updates take, so `/metrics` never fails
mid-update. Only the `max_versions` drafter versions served most recently keep their own
`version` label (and their own counts in the reports); an older one is evicted when a new one is
observed: its series end (sum `rate()` over versions, not raw counters: folding its lifetime count
into another series would read as a burst of traffic at every eviction), its per-source counts stay
in the reports' `sources` (cumulative there, so the learner never reads a restart), and a version
that is served again (a rollback to it) takes its counts back from there: its reported counts go
on from where they stopped (of the last `REMEMBERED_VERSIONS` evicted; an older one starts at zero),
so the acceptance log, which reads a drop as a restart and a rise as new drafts, counts it right.
Names (the `specd_` twins of vLLM's `vllm:spec_decode_*`):
  specd_spec_decode_num_draft_tokens_total{version,source}       drafts proposed
  specd_spec_decode_num_accepted_tokens_total{version,source}    drafts accepted
  specd_spec_decode_num_accepted_tokens_per_pos_total{position}
  specd_spec_decode_num_verification_passes_total{version,source}
  specd_spec_decode_num_emitted_tokens_total{version,source}
  specd_spec_decode_acceptance_rate{version,source}, specd_spec_decode_accept_length{version,source}  (gauges)
  specd_drafter_swaps_total, specd_drafter_refused_total
  specd_drafter_version{server}   (gauge) the version drafting now, labelled with the server id
  specd_records_published_total, specd_records_shed_total
  specd_request_latency_seconds, specd_time_to_first_token_seconds, specd_inter_token_latency_seconds
  (histograms; inter-token: streamed requests, per token after the first)
  specd_spec_decode_domain_{draft_tokens,accepted_tokens,verification_passes,emitted_tokens}_total{version,source,domain}
  specd_background_failures_total{task}   failures of supervised background loops (threads.py)
  specd_traffic_table_contexts   (gauge) contexts the hybrid's traffic table holds (absent without one)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specd.core.background_metrics import BackgroundCollector
from specd.core.records import AcceptanceCounts, AcceptanceReport, reports_from, source_kind, version_label
from specd.core.threads import BackgroundHealth

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


Key = tuple[int | None, str, str]   # (drafter version, source kind, domain)


class _DerivedRates(Collector):
    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rate = GaugeMetricFamily("specd_spec_decode_acceptance_rate", "accepted / proposed drafts",
                                 labels=["version", "source"])
        length = GaugeMetricFamily("specd_spec_decode_accept_length", "tokens emitted per target pass",
                                   labels=["version", "source"])
        summed: dict[tuple[str, str], AcceptanceCounts] = {}
        for (version, kind, _), counts in self.metrics.snapshot().items():  # evicted versions have no gauges
            summed.setdefault((version_label(version), kind), AcceptanceCounts()).add(counts)
        for labels, counts in summed.items():
            if counts.acceptance_rate is not None:
                rate.add_metric(list(labels), counts.acceptance_rate)
            if counts.accept_length is not None:
                length.add_metric(list(labels), counts.accept_length)
        yield rate
        yield length
        for name, help_text in (("specd_drafter_swaps", "drafter versions taken over"),
                                ("specd_drafter_refused", "drafter versions refused by verification"),
                                ("specd_records_shed",
                                 "trajectory records shed: a full bus, a broker down, left at stop")):
            source = self.metrics.sources.get(name)
            if source is not None:
                yield CounterMetricFamily(name, help_text, value=source())
        yield from _domain_counters(self.metrics.labelled_snapshot())
        for name, (help_text, read) in self.metrics.gauges.items():
            yield GaugeMetricFamily(name, help_text, value=read())
        serving = self.metrics.serving
        if serving is not None:
            server_id, version = serving()
            gauge = GaugeMetricFamily("specd_drafter_version", "the drafter version this server drafts with "
                                      "(no sample while it drafts with none)", labels=["server"])
            if version is not None:
                gauge.add_metric([server_id], version)
            yield gauge


DOMAIN_COUNTERS = (("draft_tokens", "drafts proposed", "drafts"), ("accepted_tokens", "drafts accepted", "accepted"),
                   ("verification_passes", "target verification passes", "passes"),
                   ("emitted_tokens", "tokens emitted", "emitted"))


def _domain_counters(totals: dict[tuple[str, str, str], AcceptanceCounts]) -> Iterator[CounterMetricFamily]:
    """specd_spec_decode_domain_*_total{version, source, domain}: what dashboards break acceptance
    down by (`totals` keyed by version label, source kind and domain)."""
    for short, help_text, field in DOMAIN_COUNTERS:
        family = CounterMetricFamily(f"specd_spec_decode_domain_{short}",
                                     f"{help_text}, by version, drafting source and domain",
                                     labels=["version", "source", "domain"])
        for labels, counts in sorted(totals.items()):
            family.add_metric(list(labels), getattr(counts, field))
        yield family


REMEMBERED_VERSIONS = 1000  # evicted versions whose own counts are kept, to go on from if served again


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, max_versions: int = 8,
                 background: BackgroundHealth | None = None) -> None:
        if max_versions < 1:
            raise ValueError(f"max_versions must be at least 1, got {max_versions}")
        self.max_versions = max_versions
        self.registry = registry or CollectorRegistry()
        r = self.registry
        by = ["version", "source"]
        self.draft_tokens = Counter("specd_spec_decode_num_draft_tokens", "drafts proposed", by, registry=r)
        self.accepted_tokens = Counter("specd_spec_decode_num_accepted_tokens", "drafts accepted", by, registry=r)
        self.accepted_per_pos = Counter("specd_spec_decode_num_accepted_tokens_per_pos",
                                        "drafts accepted at each draft position", ["position"], registry=r)
        self.passes = Counter("specd_spec_decode_num_verification_passes", "target verification passes", by,
                              registry=r)
        self.emitted = Counter("specd_spec_decode_num_emitted_tokens", "tokens emitted", by, registry=r)
        self.records_published = Counter("specd_records_published", "trajectory records published", registry=r)
        # counts owned by other objects (drafter, swapper, bus), read at scrape time
        self.sources: dict[str, Callable[[], float]] = {}
        # gauges owned by other objects, read at scrape time: name -> (help, reader)
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        # (server id, drafter version now drafting) read at scrape time: which version each server runs
        self.serving: Callable[[], tuple[str, int | None]] | None = None
        self.request_latency = Histogram("specd_request_latency_seconds", "request latency", registry=r,
                                         buckets=LATENCY_BUCKETS)
        self.inter_token_latency = Histogram("specd_inter_token_latency_seconds",
                                             "time between streamed tokens", registry=r, buckets=ITL_BUCKETS)
        self.time_to_first_token = Histogram("specd_time_to_first_token_seconds",
                                             "time from a request's arrival to its first token", registry=r,
                                             buckets=LATENCY_BUCKETS)
        # (version, source kind, domain) -> counts: what reports to the learner carry. Written by
        # the engine thread, read by scrapes and reports: only under `_lock`
        self.totals: dict[Key, AcceptanceCounts] = {}
        self._versions: OrderedDict[int | None, None] = OrderedDict()   # labelled versions, least recent first
        self._older: dict[tuple[str, str], AcceptanceCounts] = {}   # evicted versions' counts per (source, domain),
        # for the reports' cumulative per-source figures; and each evicted version's own, to take back
        self._evicted: OrderedDict[int | None, dict[tuple[str, str], AcceptanceCounts]] = OrderedDict()
        self._lock = threading.Lock()
        r.register(_DerivedRates(self))
        if background is not None:
            r.register(BackgroundCollector(background))

    def observe_verification(self, version: int | None, source: str, drafts: int, accepted: int, emitted: int,
                             domain: str = "default") -> None:
        """One verification pass of one request; `source` names who drafted (see `source_kind`)."""
        kind = source_kind(source, drafts)
        labels = (version_label(version), kind)
        with self._lock:
            if version not in self._versions:
                self._versions[version] = None
                self._take_back(version)
                while len(self._versions) > self.max_versions:
                    self._evict(next(iter(self._versions)))
            elif next(reversed(self._versions)) != version:
                self._versions.move_to_end(version)
            self.draft_tokens.labels(*labels).inc(drafts)
            self.accepted_tokens.labels(*labels).inc(accepted)
            self.passes.labels(*labels).inc()
            self.emitted.labels(*labels).inc(emitted)
            self.totals.setdefault((version, kind, domain), AcceptanceCounts()).add(
                AcceptanceCounts(drafts, accepted, 1, emitted))
        for position in range(accepted):
            self.accepted_per_pos.labels(str(position)).inc()

    def _evict(self, version: int | None) -> None:
        """End a version's series, keeping its counts for the reports' sources (caller holds `_lock`)."""
        del self._versions[version]
        sources = set()
        own = self._evicted.setdefault(version, {})
        for key in [key for key in self.totals if key[0] == version]:
            counts = self.totals.pop(key)
            self._older.setdefault(key[1:], AcceptanceCounts()).add(counts)
            own[key[1:]] = counts
            sources.add(key[1])
        while len(self._evicted) > REMEMBERED_VERSIONS:
            self._evicted.popitem(last=False)
        for source in sources:
            for counter in (self.draft_tokens, self.accepted_tokens, self.passes, self.emitted):
                counter.remove(version_label(version), source)

    def _take_back(self, version: int | None) -> None:
        """A version served again continues its counts from `_older` (caller holds `_lock`)."""
        for (source, domain), counts in self._evicted.pop(version, {}).items():
            self.totals[(version, source, domain)] = counts
            older = self._older[(source, domain)]
            self._older[(source, domain)] = older.minus(counts)

    def snapshot(self, with_evicted: bool = False) -> dict[Key, AcceptanceCounts]:
        """A consistent copy of the per-(version, source kind, domain) counts, safe on any thread;
        `with_evicted`: evicted versions' counts too, keyed without a version."""
        with self._lock:
            totals = {key: replace(counts) for key, counts in self.totals.items()}
            for (source, domain), counts in self._older.items() if with_evicted else ():
                totals.setdefault((None, source, domain), AcceptanceCounts()).add(counts)
            return totals

    def labelled_snapshot(self) -> dict[tuple[str, str, str], AcceptanceCounts]:
        """The same keyed by version label (versions still labelled only)."""
        with self._lock:
            return {(version_label(version), source, domain): replace(counts)
                    for (version, source, domain), counts in self.totals.items()}

    def observe_tokens(self, waited: float, count: int, first: bool, streamed: bool) -> None:
        """`count` tokens arrived `waited` seconds after the request did (`first`) or after the last
        ones. The first wait is time to first token, whatever the request; every token after the
        first is one inter-token sample, for streamed requests only (a non-streamed answer has no such
        gaps): a step that emits three tokens streams three, a third of the wait apart, and the tokens
        that came with the first (drafts accepted in the prefill's step) came 0 s after it. So the
        samples' mean is (request time − time to first token) / (tokens − 1), vLLM's time per output token."""
        if first:
            self.time_to_first_token.observe(waited)
            if streamed:
                for _ in range(count - 1):
                    self.inter_token_latency.observe(0.0)
        elif streamed:
            for _ in range(count):
                self.inter_token_latency.observe(waited / max(count, 1))

    def record_published(self) -> None:
        self.records_published.inc()

    def reports(self, server_id: str) -> list[AcceptanceReport]:
        """One cumulative report per traffic domain: per drafter version, of the learned drafter's
        own drafts; per source kind, of every version."""
        return reports_from(server_id, self.snapshot(with_evicted=True))  # evicted versions stay in `sources`

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
