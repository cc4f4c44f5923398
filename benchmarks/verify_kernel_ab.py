"""Does a few-row kernel change pay in serving: none and static, each with this tree's kernel and
with another source's (`--kernel-source`, say the `row_kernel.c` before the change), on traffic the
demo never serves.

Arms: `none` and `static` (the demo's static mode: the shipped day-0 hybrid drafter, context
matching, a traffic table of its own, continuations up to `CONTEXT_K` drafts, the lookahead
controller on frozen calibrated costs) with the tree's kernel, and `none@source`, `static@source`
with the other one. Each kernel's static arm runs on costs calibrated with that kernel (as
`specd demo` calibrates on the machine it runs on), so the controller may choose other k where
passes cost otherwise. Traffic: `--requests` validation chats then as many validation HumanEval
problems (`demo_learner_sweep.validation_items`), in the demo's rounds of `--round-size` requests,
the arms taking turns (the order rotates by round); before each arm's round its model's layers are
laid out for its kernel (outside the timing). Serving is pinned as the demo pins it. Per arm and
domain: tokens/s per round (median, spread), accept length; per domain the per-round ratios
static / none under each kernel and tree / source for each mode. Greedy outputs of every arm must
be equal; the run fails otherwise. Writes JSON (default out/verify_kernel_ab.json).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from common import markdown_table, paired, parser, spread, write_result
from demo_learner_sweep import pinned_validation_traffic
from tqdm import tqdm

from specd.cli.service import CONTEXT_K
from specd.demo.deployment import DemoConfig, ModeRun, calibrated_costs, new_engine, rounds_of, serve_round
from specd.drafter.factory import DrafterSpec, build_drafter, initial_model
from specd.model import packed_linear
from specd.model.row_kernel import RowKernel, kernel_from
from specd.model.target import LoadedTarget

ARMS = ("none", "static", "none@source", "static@source")
OWN_KERNEL = packed_linear.row_kernel


def use_kernel(source: RowKernel | None, modules: list[torch.nn.Module]) -> None:
    """Serve with `source` (None: the tree's kernel); lay `modules` out for it now."""
    packed_linear.row_kernel = OWN_KERNEL if source is None else (lambda: source)  # type: ignore[assignment]
    for module in modules:
        packed_linear.prepare_layouts(module)


def layers_of(drafter: object) -> list[torch.nn.Module]:
    model = getattr(drafter, "model", None)
    return [model] if isinstance(model, torch.nn.Module) else []


def summarise(runs: dict[str, ModeRun], items: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per domain: each arm's tokens/s over rounds and accept length, and the per-round ratios; printed too."""
    domains = list(dict.fromkeys(item.domain for item in items))
    per_round = {arm: [{"domain": r["domain"], "tok_s": r["tokens"] / r["seconds"]} for r in runs[arm].rounds]
                 for arm in ARMS}
    summary, ratios = {}, {}
    for domain in domains:
        rounds = {arm: [r for r in per_round[arm] if r["domain"] == domain] for arm in ARMS}
        served = {arm: [r for r in runs[arm].rounds if r["domain"] == domain] for arm in ARMS}
        summary[domain] = {arm: {"tokens_per_s": spread([r["tok_s"] for r in rounds[arm]]),
                                 "accept_length": sum(r["tokens"] for r in served[arm])
                                 / sum(r["target_passes"] for r in served[arm])} for arm in ARMS}
        ratios[domain] = {name: paired(rounds, a, b, "tok_s") for name, (a, b) in {
            "static/none": ("static", "none"), "static@source/none@source": ("static@source", "none@source"),
            "static/static@source": ("static", "static@source"), "none/none@source": ("none", "none@source")}.items()}
        print(f"## {domain}")
        print(markdown_table(["arm", "tok/s (median)", "accept len"],
                             [[arm, f"{s['tokens_per_s']['median']:.1f}", f"{s['accept_length']:.2f}"]
                              for arm, s in summary[domain].items()]))
        for name, ratio in ratios[domain].items():
            print(f"{name}: per round median {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})")
    return summary, ratios


def main() -> None:
    p = parser(__doc__, "out/verify_kernel_ab.json", repeats=None)
    p.add_argument("--kernel-source", type=Path, required=True, help="the other kernel's C source")
    p.add_argument("--requests", type=int, default=16, help="validation chats, and as many HumanEval problems")
    p.add_argument("--round-size", type=int, default=4, help="requests per arm per round (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64, the demo's)")
    args = p.parse_args()
    source = kernel_from(args.kernel_source)
    loaded = LoadedTarget.load(None)
    config = DemoConfig(max_tokens=args.max_tokens, drafter=DrafterSpec(context_k=CONTEXT_K), learning=False)
    items, prompts = pinned_validation_traffic(loaded, args.requests)
    torch.manual_seed(0)
    runs, costs = {}, {}
    for kernel_name, kernel in (("tree", None), ("source", source)):
        drafter = build_drafter(config.drafter, initial_model(loaded.model, config.drafter,
                                                              fingerprint=loaded.fingerprint), version=1)
        use_kernel(kernel, [loaded.model, *layers_of(drafter)])
        costs[kernel_name] = calibrated_costs(loaded, drafter, prompts, config)
        suffix = "" if kernel is None else "@source"
        runs["none" + suffix] = ModeRun("none" + suffix, new_engine(loaded, None, config, False, None))
        runs["static" + suffix] = ModeRun("static" + suffix, new_engine(loaded, drafter, config, False,
                                                                          costs[kernel_name]), drafter)
    with tqdm(total=len(items) * len(ARMS), unit="req", desc="kernel A/B") as bar:
        for number, (domain, indices) in enumerate(rounds_of(items, args.round_size)):
            shift = number % len(ARMS)
            for arm in ARMS[shift:] + ARMS[:shift]:
                use_kernel(source if arm.endswith("@source") else None, [loaded.model, *layers_of(runs[arm].drafter)])
                serve_round(runs[arm], number, domain, indices, items, prompts, config, bar)
    use_kernel(None, [])
    outputs = {arm: [runs[arm].results[i].output_ids for i in range(len(items))] for arm in ARMS}
    if any(outputs[arm] != outputs["none"] for arm in ARMS):
        raise SystemExit("the arms' greedy outputs differ: a kernel or verification is broken")
    summary, ratios = summarise(runs, items)
    write_result(args.out, args, {
        "cores": sorted(os.sched_getaffinity(0)),
        "panel_width": {"tree": getattr(OWN_KERNEL(), "panel_width", None), "source": source.panel_width},
        "lookahead_costs": {name: c.verify_seconds for name, c in costs.items()},
        "k_choices": {arm: {str(k): runs[arm].step_k.count(k) for k in sorted(set(runs[arm].step_k))}
                      for arm in ("static", "static@source")},
        "summary": summary, "ratios": ratios, "outputs_equal": True})


if __name__ == "__main__":
    main()
