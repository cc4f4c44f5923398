"""The demo's figures: per-mode summaries, per-round ratios with their spread, the adaptation curve, the plot.

Contract: pure functions over what `specd.demo.deployment` measured (no decoding, except `adaptation_curve`,
which replays each published version on held-out requests of the shifted domain after the run).
- `summarise`: per domain, requests, accept length (tokens per target pass), acceptance rate and
  tokens/s (tokens over the wall time of the mode's rounds of that domain).
- `round_figures`: each round's tokens/s and accept length per mode, and the per-round ratios
  adaptive/static, adaptive/none and static/none; per domain their median, min and max.
- `adaptation_curve`: for every version the learner published (passed or rejected), how many
  records of the shifted domain it had been sent by then, and its accept length, learned drafter
  alone at k, greedy, on held-out requests the demo never served.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specd.core.traffic import TrafficItem
from specd.drafter.checkpoint import load_drafter
from specd.drafter.feature_model import FeatureDrafterModel
from specd.hotswap.store import WeightStore
from specd.learner.simulation import simulated_counts
from specd.model.target import LoadedTarget
from specd.offline.corpus import greedy_continuations

MODES = ("adaptive", "static", "none")
RATIOS = (("adaptive", "static"), ("adaptive", "none"), ("static", "none"))


def summarise(requests: list[dict[str, Any]], rounds: list[dict[str, Any]], domains: list[str]) -> dict[str, Any]:
    summary = {}
    for domain in domains:
        rows = [r for r in requests if r["domain"] == domain]
        tokens = sum(r["tokens"] for r in rows)
        proposed = sum(r["drafts_proposed"] for r in rows)
        seconds = sum(r["seconds"] for r in rounds if r["domain"] == domain)
        summary[domain] = {
            "requests": len(rows),
            "accept_length": tokens / max(sum(r["target_passes"] for r in rows), 1),
            "acceptance_rate": sum(r["drafts_accepted"] for r in rows) / proposed if proposed else 0.0,
            "tokens_per_s": tokens / seconds if seconds else 0.0}
    return summary


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def round_figures(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per round and mode: tokens/s and accept length; per-round ratios; per domain their spread."""
    table = []
    for number, first in enumerate(rounds["none"]):
        row: dict[str, Any] = {"round": first["round"], "domain": first["domain"],
                               "first_request": first["first_request"], "requests": first["requests"],
                               "modes": {}}
        for mode in MODES:
            done = rounds[mode][number]
            row["modes"][mode] = {"tokens_per_s": done["tokens"] / max(done["seconds"], 1e-9),
                                  "accept_length": done["tokens"] / max(done["target_passes"], 1),
                                  "seconds": done["seconds"], "decoding_seconds": done["decoding_seconds"]}
        row["ratios"] = {f"{a}/{b}": row["modes"][a]["tokens_per_s"] / row["modes"][b]["tokens_per_s"]
                         for a, b in RATIOS}
        row["ratios"]["adaptive/static accept_length"] = (row["modes"]["adaptive"]["accept_length"]
                                                          / row["modes"]["static"]["accept_length"])
        table.append(row)
    by_domain: dict[str, Any] = {}
    for domain in dict.fromkeys(r["domain"] for r in table):
        rows = [r for r in table if r["domain"] == domain]
        by_domain[domain] = {
            "rounds": len(rows),
            "tokens_per_s": {mode: spread([r["modes"][mode]["tokens_per_s"] for r in rows]) for mode in MODES},
            "ratios": {name: spread([r["ratios"][name] for r in rows]) for name in rows[0]["ratios"]}}
    return {"per_round": table, "by_domain": by_domain}


def swap_timing(step_seconds: list[float], step_versions: list[int | None]) -> dict[str, Any]:
    """The longest step at or right after a drafter change, against the median step."""
    swaps = [i for i in range(1, len(step_versions)) if step_versions[i] != step_versions[i - 1]]
    around = [step_seconds[j] for i in swaps for j in (i, i + 1) if j < len(step_seconds)]
    median = statistics.median(step_seconds) if step_seconds else 0.0
    return {"swaps": len(swaps), "median_step_s": median, "max_step_around_swap_s": max(around, default=0.0),
            "ratio": max(around, default=0.0) / median if median else None}


def versions_served(requests: list[dict[str, Any]], domain: str | None) -> list[int | None]:
    """The drafter versions that served requests (of `domain`, or all), in order of first use (None:
    no drafter)."""
    return list(dict.fromkeys(r["drafter_version"] for r in requests
                              if domain is None or r["domain"] == domain))


def adaptation_curve(loaded: LoadedTarget, store: WeightStore, held_out: list[TrafficItem],
                     sent: list[tuple[float, str]], domain: str, k: int, max_tokens: int,
                     encode: Callable[[LoadedTarget, TrafficItem], list[int]]) -> list[dict[str, Any]] | None:
    points: list[dict[str, Any]] = []
    trajectories = None
    for version in store.versions():
        manifest = store.manifest(version)
        model = load_drafter(store.weights_path(version), loaded.fingerprint,
                             target_embedding=loaded.model.embed.weight)
        if not isinstance(model, FeatureDrafterModel):
            return None  # the curve replays feature drafters (a token drafter's is not measured here)
        if trajectories is None:
            prompts = [encode(loaded, item) for item in held_out]
            trajectories = greedy_continuations(loaded, prompts, max_tokens, model.config.capture_layers)
        counts = simulated_counts(model.float().eval(), trajectories, k)
        points.append({"version": version, "status": manifest.get("status"),
                       "records_after_shift": sum(1 for when, d in sent if d == domain and when < manifest["created"]),
                       "learner_steps": manifest.get("learner_steps", 0),
                       "accept_length": counts.accept_length})
    return points


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    colours = {"adaptive": "tab:green", "static": "tab:orange", "none": "tab:gray"}
    per_round = result["rounds"]["per_round"]
    for mode in MODES:
        rows = result["requests"][mode]
        top.plot([r["index"] for r in rows], [r["accept_length"] for r in rows], marker=".", lw=1,
                 color=colours[mode], label=mode)
        rates = [row["modes"][mode]["tokens_per_s"] for row in per_round]
        # each round's rate spans its requests: the last one ends where its requests do
        last = per_round[-1]
        ends = [row["first_request"] for row in per_round] + [last["first_request"] + last["requests"]]
        bottom.step(ends, rates + rates[-1:], where="post", color=colours[mode], label=mode)
    adaptive = result["requests"]["adaptive"]
    swaps = [r["index"] for a, r in itertools.pairwise(adaptive) if r["drafter_version"] != a["drafter_version"]]
    first_domain = result["domains"][0]
    boundary = sum(1 for r in adaptive if r["domain"] == first_domain)
    for axis in (top, bottom):
        for i, x_swap in enumerate(swaps):
            axis.axvline(x_swap, color="tab:green", alpha=0.3, lw=1, label="new version live" if i == 0 else None)
        axis.axvline(boundary - 0.5, color="black", ls="--", label=f"shift: {first_domain} → {result['domains'][-1]}")
    top.set_ylabel("accept length (tokens per target pass)")
    top.set_title("specd demo: adaptive vs static vs no speculation, interleaved in rounds")
    top.legend(loc="upper left", fontsize=8)
    bottom.set_ylabel("tokens/s (per round)")
    bottom.set_xlabel("request")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

