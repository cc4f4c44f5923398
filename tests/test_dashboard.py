"""The dashboard in a real browser (headless Chromium via Playwright): charts, versions, rollback."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from specd.drafter.token_drafter import DrafterShape, new_drafter_model
from specd.hotswap.store import WeightStore
from specd.model.target import LoadedTarget
from specd.testing.processes import SpecdProcess, chromium_binary, free_port, get_json, tiny_checkpoint, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.slow]  # conftest fails it when Playwright or Chromium is missing


def chat(url: str, question: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=60).read()


def test_dashboard_renders_live_charts_and_rolls_back_from_the_page(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    checkpoint = tiny_checkpoint(tmp_path / "tiny")
    loaded = LoadedTarget.load(checkpoint)
    store = WeightStore(tmp_path / "store")
    shape = DrafterShape.like(loaded.model.config, 1, 4096)
    for seed in (0, 1):
        version = store.publish(new_drafter_model(loaded.model, shape, seed=seed), loaded.fingerprint,
                                store.live_version(), {})
        store.set_live(version)
    # a refused candidate whose reason carries markup: shown as text, never parsed as HTML
    refused = store.publish(new_drafter_model(loaded.model, shape, seed=2), loaded.fingerprint, 2, {})
    store.update(refused, status="rejected", reason="<b id='injected'>worse</b>")
    server = SpecdProcess(["serve", "--target", str(checkpoint), "--store", str(tmp_path / "store"), "--no-learner",
                           "--model-name", "tiny", "--token", "secret"], free_port(), tmp_path / "serve.log").start()
    try:
        wait_for(lambda: server.health()["drafter_version"] == 2, 30, what="server on version 2")
        for question in ("Hello there", "What is two plus two?", "Tell me a joke", "Name a colour"):
            chat(server.url, question)
        wait_for(lambda: get_json(server.url + "/v1/acceptance")["series"], 20, what="acceptance reports")
        store.pin(2)   # an operator's pin: an event on the page, as swaps and rollbacks are
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium_binary(), args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run"])
            page = browser.new_page()
            page.on("dialog", lambda dialog: dialog.accept("secret") if dialog.type == "prompt" else dialog.accept())
            page.goto(server.url + "/dashboard")
            page.wait_for_function("document.querySelectorAll('#rate polyline.series').length > 0", timeout=20000)
            assert page.locator("#length polyline.series").count() > 0
            assert page.locator("#source-rate polyline.series").count() > 0  # acceptance per drafting source
            assert page.locator("#domain-length polyline.series").count() > 0  # and per traffic domain
            assert "v2 pinned" in page.locator("#events li.pin").inner_text()
            assert "need not agree" in page.locator("#gate-note").inner_text()  # gate replay vs served figures
            assert int(page.locator("#rate").get_attribute("data-points") or 0) > 0
            assert page.locator("#versions tbody tr").count() == 3
            assert page.locator("#injected").count() == 0
            assert "<b id='injected'>worse</b>" in page.locator(f"#versions tr[data-version='{refused}']").inner_text()
            assert page.locator(f"#versions tr[data-version='{refused}'] button").count() == 0  # never served
            assert "live: v2" in page.locator("#live").inner_text()
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)  # for people: see the log
            page.click("#versions tr[data-version='1'] button")
            page.wait_for_function("document.querySelector('#live').textContent.includes('v1')", timeout=20000)
            # the operator's rollback is marked as the canary's would be
            page.wait_for_function("document.querySelectorAll('#events li.rolled-back').length > 0", timeout=20000)
            browser.close()
        wait_for(lambda: server.health()["drafter_version"] == 1, 15, what="the rollback reaching the server")
        assert store.manifest(2)["status"] == "rolled-back"
    finally:
        server.stop()
