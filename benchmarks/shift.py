"""The shift run on SmolLM2: adaptive vs static vs no speculation, ShareGPT then HumanEval, repeated.

Each repeat is one `specd demo` run (`specd.demo.deployment.run_demo`) with its own seed (the day-0 drafter
and the learner's): `adaptive`, `static` and `none` decode the same traffic greedily one after
the other, so over `--repeats` the modes run interleaved (A S N, A S N, ...). Both drafters are
built by `specd.drafter.factory.build_drafter` from the same spec, each with a traffic table of
its own that learns the same requests in the same order, and both have context matching: the
static drafter differs only in that its learned part is frozen (the adaptive run's live version
at the end of the first domain), so the gap between them measures learning. k is fixed unless
`--adaptive-k`. Tokens are the engine's output token ids.
Per repeat and then as median (min–max) over repeats: per mode and domain the accept length and
tokens/s; adaptive/static accept length after the shift; adaptive tokens/s over none's; how many
requests after the shift the adaptive drafter needs before its running accept length passes the
static one's; learner throughput (trained tokens/s) against serving's; swap timing (longest step
around a swap over the median step); whether every mode's outputs equal none's.
Writes JSON (default out/shift.json) with every repeat and a plot of the first (shift.png).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import cell, markdown_table, parser, spread, write_result

from specd.core.traffic import default_shift_traffic
from specd.demo.deployment import MODES, DemoConfig, run_demo
from specd.demo.report import plot
from specd.drafter.factory import DrafterSpec
from specd.learner.config import LearnerConfig
from specd.model.target import LoadedTarget

GOALS = ("adaptive_over_static_accept_length_after_shift", "adaptive_over_none_tokens_per_s_after_shift",
         "adaptive_over_none_tokens_per_s_first_domain", "requests_after_shift_to_pass_static",
         "learner_tokens_per_s", "serving_tokens_per_s", "swap_step_over_median_step")


def requests_to_pass(adaptive: list[dict], static: list[dict], domain: str, window: int = 5) -> int | None:
    a = [r["accept_length"] for r in adaptive if r["domain"] == domain]
    s = [r["accept_length"] for r in static if r["domain"] == domain]
    for end in range(window, len(a) + 1):
        if sum(a[end - window:end]) > sum(s[end - window:end]):
            return end
    return None


def goals(result: dict[str, Any]) -> dict[str, Any]:
    first, second = result["domains"][0], result["domains"][-1]
    summary, adaptive = result["summary"], result["requests"]["adaptive"]
    # the adaptive run's decoding wall time, domain by domain (tokens / tokens-per-second)
    wall = sum(sum(r["tokens"] for r in adaptive if r["domain"] == d) / summary["adaptive"][d]["tokens_per_s"]
               for d in result["domains"])
    return {
        "adaptive_over_static_accept_length_after_shift":
            summary["adaptive"][second]["accept_length"] / summary["static"][second]["accept_length"],
        "adaptive_over_none_tokens_per_s_after_shift":
            summary["adaptive"][second]["tokens_per_s"] / summary["none"][second]["tokens_per_s"],
        "adaptive_over_none_tokens_per_s_first_domain":
            summary["adaptive"][first]["tokens_per_s"] / summary["none"][first]["tokens_per_s"],
        "requests_after_shift_to_pass_static": requests_to_pass(adaptive, result["requests"]["static"], second),
        "learner_tokens_per_s": result["learner"]["tokens_trained"] / wall,
        "serving_tokens_per_s": sum(r["tokens"] for r in adaptive) / wall,
        "swap_step_over_median_step": result["swap_timing"]["ratio"] if result["swap_timing"]["swaps"] else None,
    }


def main() -> None:
    p = parser(__doc__, "out/shift.json", repeats=2)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--drafter-layers", type=int, default=1)
    p.add_argument("--duty-cycle", type=float, default=0.5)
    p.add_argument("--adaptive-k", action="store_true", help="lookahead controller on (default: fixed k)")
    p.add_argument("--drafter-kind", choices=["hybrid", "learned"], default="hybrid")
    args = p.parse_args()
    loaded = LoadedTarget.load(None)
    items = default_shift_traffic(args.requests)
    repeats = []
    for seed in range(args.repeats):
        config = DemoConfig(max_tokens=args.max_tokens, max_batch=args.batch, adaptive_lookahead=args.adaptive_k,
                            drafter=DrafterSpec(kind=args.drafter_kind, layers=args.drafter_layers), seed=seed,
                            learner=LearnerConfig(duty_cycle=args.duty_cycle, seed=seed))
        print(f"repeat {seed + 1}/{args.repeats} (seed {seed})", flush=True)
        result = run_demo(loaded, items, config)
        result["goals"] = goals(result)
        repeats.append(result)
        print(brief_table(result), flush=True)
    domains = repeats[0]["domains"]
    summary = {mode: {d: {f: spread([r["summary"][mode][d][f] for r in repeats])
                          for f in ("accept_length", "acceptance_rate", "tokens_per_s")} for d in domains}
               for mode in MODES}
    out = {"domains": domains, "summary": summary,
           "goals": {g: spread([r["goals"][g] for r in repeats]) for g in GOALS},
           "lossless": all(all(r["lossless"].values()) for r in repeats), "repeats": repeats}
    path = write_result(args.out, args, out)
    print(markdown(out, path.parent))


def brief_table(result: dict[str, Any]) -> str:
    return "\n".join(f"{mode:9} {domain:10} n={row['requests']:3d} accept_len={row['accept_length']:.2f} "
                     f"acceptance={row['acceptance_rate']:.1%} tok/s={row['tokens_per_s']:.1f}"
                     for mode, domains in result["summary"].items() for domain, row in domains.items())


def markdown(result: dict[str, Any], out: Path, draw: bool = True) -> str:
    rows = [[mode, domain, cell(s["accept_length"], 2), cell(s["acceptance_rate"], 2), cell(s["tokens_per_s"])]
            for mode, domains in result["summary"].items() for domain, s in domains.items()]
    text = markdown_table(["mode", "domain", "accept length", "acceptance", "tokens/s"], rows)
    g = {k: spread([r["goals"][k] for r in result["repeats"]]) for k in GOALS}  # from the repeats themselves
    names = {"adaptive_over_static_accept_length_after_shift": "accept length after the shift, adaptive / static",
             "adaptive_over_none_tokens_per_s_after_shift": "tokens/s after the shift, adaptive / none",
             "adaptive_over_none_tokens_per_s_first_domain": "tokens/s in the first domain, adaptive / none",
             "requests_after_shift_to_pass_static": "requests after the shift until adaptive passes static "
                                                    "(none: never)",
             "learner_tokens_per_s": "learner: trained tokens/s",
             "serving_tokens_per_s": "serving: produced tokens/s (adaptive run)",
             "swap_step_over_median_step": "longest step around a swap / median step"}
    text += "\n\n" + markdown_table(["figure (per repeat)", "median (min–max)"],
                                    [[names[k], cell(g[k], 0 if k.startswith("requests") else 2)] for k in GOALS])
    text += f"\n\nEvery mode's greedy outputs equal `none`'s in every repeat: {result['lossless']}."
    if draw:
        plot(result["repeats"][0], out / "shift.png")
        text += "\n\n![accept length over requests, first repeat](shift.png)"
    return text


if __name__ == "__main__":
    main()
