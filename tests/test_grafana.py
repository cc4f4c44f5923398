"""The Grafana dashboard in deploy/grafana: valid, and every query names metrics specd exports.

The dashboard is loaded as Grafana would import it; each panel's PromQL is scanned for `specd_`
metric names, and each must be in what an embedded `specd serve` (serving metrics and the
learner's beside them) or the learner sidecar actually exposes after some labelled traffic.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from specd.drafter.factory import DrafterSpec
from specd.serving.serve import ServeOptions, build_server
from specd.testing import ByteTokenizer, tiny_loaded_target

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "specd-dashboard.json"
HISTOGRAM_PARTS = ("_bucket", "_count", "_sum")


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def metric_names(expression: str) -> set[str]:
    return set(re.findall(r"\bspecd_[a-z0-9_]+", expression))


def exported_samples(exposition: str) -> set[str]:
    """Every sample name in a Prometheus exposition (counters with _total, histograms with _bucket...)."""
    return {sample.name for family in text_string_to_metric_families(exposition) for sample in family.samples}


def test_dashboard_is_importable_json_with_the_panels_operators_need() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(panel["title"].lower() for panel in dashboard["panels"])
    for needed in ("acceptance rate", "accept length", "tokens/s", "swaps", "rollbacks", "learner lag"):
        assert needed in titles, f"no panel for {needed}"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"]["uid"] == "${datasource}"  # works with whatever Prometheus it is imported to
    # acceptance and accept length are broken down by version and domain
    by_version_and_domain = [e for e in dashboard_queries() if "by (version, domain)" in e]
    assert len(by_version_and_domain) >= 2


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
    exported = exported_samples(exposition)
    missing = {}
    for expression in dashboard_queries():
        for name in metric_names(expression):
            if name not in exported:
                missing[name] = expression
    assert not missing, f"the dashboard queries metrics specd does not export: {sorted(missing)}"
    # and the labels the panels group by are there
    domains = {s.labels.get("domain") for f in text_string_to_metric_families(exposition) for s in f.samples
               if s.name == "specd_spec_decode_domain_draft_tokens_total"}
    assert {"chat", "code"} <= domains
