"""The shift run on SmolLM2: adaptive vs static vs no speculation, ShareGPT then HumanEval.

Larger than `specd demo`'s default (more requests, longer outputs). Prints and writes JSON
(default out/shift.json, plot out/shift.png): per mode and domain the accept length and tokens/s;
the adaptive/static accept-length ratio after the shift; adaptive tokens/s over no speculation;
how many requests after the shift the adaptive drafter needs before its running accept length
passes the static one's; learner throughput (trained tokens per second) against the rate at
which serving produced tokens; and the swap timing (longest step around a swap vs median step).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specd.demo import DemoConfig, plot, run_demo
from specd.drafter.factory import DrafterSpec
from specd.learner.learner import LearnerConfig
from specd.model.target import LoadedTarget
from specd.traffic import default_shift_traffic


def requests_to_pass(adaptive: list[dict], static: list[dict], domain: str, window: int = 5) -> int | None:
    a = [r["accept_length"] for r in adaptive if r["domain"] == domain]
    s = [r["accept_length"] for r in static if r["domain"] == domain]
    for end in range(window, len(a) + 1):
        if sum(a[end - window:end]) > sum(s[end - window:end]):
            return end
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--drafter-layers", type=int, default=1)
    parser.add_argument("--duty-cycle", type=float, default=0.5)
    parser.add_argument("--adaptive-k", action="store_true", help="lookahead controller on (default: fixed k)")
    parser.add_argument("--drafter-kind", choices=["hybrid", "learned"], default="hybrid")
    parser.add_argument("--out", default="out/shift.json")
    args = parser.parse_args()
    loaded = LoadedTarget.load(None)
    items = default_shift_traffic(args.requests)
    config = DemoConfig(max_tokens=args.max_tokens, max_batch=args.batch, adaptive_lookahead=args.adaptive_k,
                        drafter=DrafterSpec(kind=args.drafter_kind, layers=args.drafter_layers),
                        learner=LearnerConfig(duty_cycle=args.duty_cycle))
    result = run_demo(loaded, items, config)
    first, second = result["domains"][0], result["domains"][-1]
    summary = result["summary"]
    produced = sum(r["tokens"] for r in result["requests"]["adaptive"])
    # the adaptive run's decoding wall time, domain by domain (tokens / tokens-per-second)
    wall = sum(sum(r["tokens"] for r in result["requests"]["adaptive"] if r["domain"] == d)
               / summary["adaptive"][d]["tokens_per_s"] for d in result["domains"])
    result["goals"] = {
        "adaptive_over_static_accept_length_after_shift":
            summary["adaptive"][second]["accept_length"] / summary["static"][second]["accept_length"],
        "adaptive_over_none_tokens_per_s_after_shift":
            summary["adaptive"][second]["tokens_per_s"] / summary["none"][second]["tokens_per_s"],
        "adaptive_over_none_tokens_per_s_first_domain":
            summary["adaptive"][first]["tokens_per_s"] / summary["none"][first]["tokens_per_s"],
        "requests_after_shift_to_pass_static": requests_to_pass(result["requests"]["adaptive"],
                                                                result["requests"]["static"], second),
        "learner_tokens_per_s": result["learner"]["tokens_trained"] / wall,
        "serving_tokens_per_s": produced / wall,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    plot(result, Path(args.out).with_suffix(".png"))
    for mode, domains in summary.items():
        for domain, row in domains.items():
            print(f"{mode:9} {domain:10} n={row['requests']:3d} accept_len={row['accept_length']:.2f} "
                  f"acceptance={row['acceptance_rate']:.1%} tok/s={row['tokens_per_s']:.1f}")
    print(json.dumps({"goals": result["goals"], "swap_timing": result["swap_timing"],
                      "lossless": result["lossless"]}, indent=2))


if __name__ == "__main__":
    main()
