"""The Grafana dashboard in deploy/grafana: valid, and every query names metrics specd exports.

The dashboard is loaded as Grafana would import it (unique ids, panels that do not overlap); each
panel's PromQL is scanned for `specd_` metric names, and each must be in what an embedded `specd
serve` (serving metrics and the learner's beside them) or the learner sidecar actually exposes
after some labelled traffic; `rate()` and `increase()` read counters and histogram series only.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specd.drafter.factory import DrafterSpec
from specd.serving.serve import ServeOptions, build_server
from specd.testing import ByteTokenizer, tiny_loaded_target

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "specd-dashboard.json"


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def metric_names(expression: str) -> set[str]:
    return set(re.findall(r"\bspecd_[a-z0-9_]+", expression))


def test_dashboard_is_importable_json_with_the_panels_operators_need() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(panel["title"].lower() for panel in dashboard["panels"])
    for needed in ("acceptance rate", "accept length", "tokens/s", "swaps", "rollbacks", "learner lag",
                   "time to first token", "inter-token", "drafter version by server", "records missing",
                   "learner ranks"):
        assert needed in titles, f"no panel for {needed}"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    taken = [(x, y) for panel in dashboard["panels"] for g in [panel["gridPos"]]
             for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])]
    assert len(taken) == len(set(taken)), "panels overlap"
    assert all(x < 24 for x, _ in taken)
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"]["uid"] == "${datasource}"  # works with whatever Prometheus it is imported to
    # acceptance and accept length are broken down by version and domain
    by_version_and_domain = [e for e in dashboard_queries() if "by (version, domain)" in e]
    assert len(by_version_and_domain) >= 2


def counter_reads(expression: str) -> set[str]:
    """The series a `rate(...)` or `increase(...)` reads."""
    return set(re.findall(r"\b(?:rate|increase)\((specd_[a-z0-9_]+)", expression))


def sidecar_exposition(store: Path) -> str:
    """What the learner sidecar's /metrics serves (its own registry), and what rank 0 of a group of
    two adds (every rank's gauges, from their status files)."""
    from prometheus_client import CollectorRegistry

    from specd.learner.collector import LearnerCollector
    from specd.learner.ranks import RankInfo, read_statuses, write_status
    from specd.learner.sidecar import Sidecar, SidecarOptions

    sidecar = Sidecar(SidecarOptions(store=str(store)), tiny_loaded_target())
    try:
        for rank in (0, 1):
            write_status(store, RankInfo(rank, 2, rank), {"records_in": 3 + rank, "steps": 2})
        ranks = CollectorRegistry()
        ranks.register(LearnerCollector(sidecar.learner, sidecar.store, ranks=lambda: read_statuses(store)))
        return generate_latest(sidecar.registry).decode() + generate_latest(ranks).decode()
    finally:
        sidecar.spool.close()
        sidecar.claim.release()


@pytest.mark.asyncio
async def test_every_dashboard_query_names_metrics_specd_exports(tmp_path: Path) -> None:
    loaded = replace(tiny_loaded_target(), tokenizer=ByteTokenizer())
    app = build_server(ServeOptions(store=str(tmp_path / "store"), model_name="tiny",
                                    drafter=DrafterSpec(head_vocab=200), report_seconds=0.1), loaded)
    async with TestClient(TestServer(app)) as client:
        for domain in ("chat", "code"):
            body = {"model": "tiny", "prompt": "hello " + domain, "max_tokens": 8, "temperature": 0,
                    "metadata": {"domain": domain}}
            assert (await client.post("/v1/completions", json=body)).status == 200
        exposition = await (await client.get("/metrics")).text()
    families = [*text_string_to_metric_families(exposition),
                *text_string_to_metric_families(sidecar_exposition(tmp_path / "learner-store"))]
    exported = {sample.name for family in families for sample in family.samples}
    missing = {}
    dashboard = json.loads(DASHBOARD.read_text())
    variables = [variable["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"]
    for expression in [*dashboard_queries(), *variables]:
        for name in metric_names(expression):
            if name not in exported:
                missing[name] = expression
    assert not missing, f"the dashboard queries metrics specd does not export: {sorted(missing)}"
    accumulating = {sample.name for family in families if family.type in ("counter", "histogram")
                    for sample in family.samples}
    over_gauges = {name for e in dashboard_queries() for name in counter_reads(e) if name not in accumulating}
    assert not over_gauges, f"rate() or increase() over series that are not counters: {sorted(over_gauges)}"
    versions = [s for f in families for s in f.samples if s.name == "specd_drafter_version"]
    assert [s.labels for s in versions] == [{"server": "specd-0"}]  # which version each server drafts with
    # and the labels the panels group by are there
    domains = {s.labels.get("domain") for f in text_string_to_metric_families(exposition) for s in f.samples
               if s.name == "specd_spec_decode_domain_draft_tokens_total"}
    assert {"chat", "code"} <= domains
