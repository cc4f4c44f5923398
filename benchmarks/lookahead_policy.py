"""What should the lookahead govern (the learned drafter alone or every source), how far should a
hybrid's continuations reach, and how should the calibrated pass costs be fitted?

Arms of the demo's static mode (the shipped day-0 drafter, hybrid with context matching, a
traffic table of its own and continuations up to `CONTEXT_K` drafts; batch 1; the lookahead
controller on step costs calibrated once, as in `specd demo`, from one calibration's samples
shared by every arm) that differ in `EngineConfig.lookahead_scope`, `continuation_reach` and the
fit of the frozen costs alone:
- "before" (the policy before 2026-12-07): k covers every source (at k = 0 nothing is drafted,
  acceptance counts every row), continuations reach `CONTEXT_K`, costs the Theil–Sen line through
  the medians of k = 0..4 (the widths calibrated then);
- "scope": k is the learned drafter's lookahead (continuations served at every k, 0 included; the
  controller's acceptance the learned rows' own); otherwise as "before";
- "scope+reach": as "scope", each kind of continuation reaching as far as its measured acceptance
  pays for against the pass's cost;
- "now" (the default): as "scope+reach", costs each width's median made non-decreasing, every
  width up to `CONTEXT_K` calibrated.
Traffic is validation traffic the demo never serves (`demo_learner_sweep.validation_items`):
`--requests` ShareGPT chats, then as many HumanEval problems (the shift), served in the demo's
rounds of `--round-size` requests with the arms taking turns (the order rotates by round), each
served by `specd.demo.deployment.serve_round` as the demo serves. Per arm and domain: accept
length (tokens per target pass), tokens/s per round (median, spread, per-round ratios against
"before"), the share of steps at each k, and the first round of the second domain apart (where the
old policy's k = 0 trap showed). Greedy outputs of the arms must be equal; the run fails otherwise.
Serving is pinned as the demo pins it (its serving core(s), as many threads). Writes
out/lookahead_policy.json.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch
from common import markdown_table, paired, parser, spread, write_result
from demo_learner_sweep import pinned_validation_traffic
from tqdm import tqdm

from specd.cli.service import CONTEXT_K
from specd.demo.deployment import DemoConfig, ModeRun, calibration_samples, rounds_of, serve_round
from specd.drafter.factory import DrafterSpec, build_drafter, initial_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.lookahead import LookaheadCosts
from specd.model.target import LoadedTarget

# arm -> (lookahead_scope, continuation_reach, cost fit)
ARMS = {"before": ("all", "fixed", "line"), "scope": ("learned", "fixed", "line"),
        "scope+reach": ("learned", "measured", "line"), "now": ("learned", "measured", "monotone")}


def frozen(samples: LookaheadCosts, fit: str, widest: int) -> LookaheadCosts:
    """The calibration's samples of widths up to `widest`, frozen with `fit`."""
    kept = LookaheadCosts(keep_samples=True)
    kept.samples = {k: pairs for k, pairs in samples.samples.items() if k <= widest}
    return kept.frozen_copy(fit)


def engine_for(loaded: LoadedTarget, config: DemoConfig, arm: str, costs: LookaheadCosts | None) -> Engine:
    drafter = build_drafter(config.drafter, initial_model(loaded.model, config.drafter,
                                                          fingerprint=loaded.fingerprint), version=1)
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=config.max_batch, num_draft_tokens=config.k,
                                                        eos_token_ids=loaded.eos_token_ids,
                                                        lookahead_scope=ARMS[arm][0],
                                                        continuation_reach=ARMS[arm][1]))
    if costs is not None:
        engine.lookahead.costs = costs
    return engine


def summarise(run: ModeRun, ks_by_round: list[list[int]]) -> dict[str, Any]:
    """Per domain: accept length, tokens/s per round, k shares, and the domain's first round apart
    (`ks_by_round`: the k of each decoding step, round by round)."""
    by_domain: dict[str, Any] = {}
    for domain in dict.fromkeys(r["domain"] for r in run.rounds):
        mine = [(r, ks) for r, ks in zip(run.rounds, ks_by_round, strict=True) if r["domain"] == domain]
        tokens = sum(r["tokens"] for r, _ in mine)
        passes = sum(r["target_passes"] for r, _ in mine)
        k_counts = Counter(k for _, ks in mine for k in ks)
        first, first_ks = mine[0]
        by_domain[domain] = {
            "accept_length": tokens / passes, "tokens_per_s": spread([r["tokens"] / r["seconds"] for r, _ in mine]),
            "k_share": {str(k): n / max(1, sum(k_counts.values())) for k, n in sorted(k_counts.items())},
            "first_round": {"accept_length": first["tokens"] / first["target_passes"],
                            "tokens_per_s": first["tokens"] / first["seconds"],
                            "k0_steps": first_ks.count(0), "steps": len(first_ks)},
            "rounds": [{"tokens": r["tokens"], "passes": r["target_passes"], "seconds": r["seconds"]} for r, _ in mine]}
    return by_domain


def main() -> None:
    p = parser(__doc__, "out/lookahead_policy.json", repeats=None)
    p.add_argument("--requests", type=int, default=20, help="requests per domain (default 20)")
    p.add_argument("--round-size", type=int, default=4, help="requests of one domain per arm per round (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64, the demo's)")
    args = p.parse_args()
    loaded = LoadedTarget.load(None)
    config = DemoConfig(max_tokens=args.max_tokens, drafter=DrafterSpec(context_k=CONTEXT_K), learning=False)
    items, prompts = pinned_validation_traffic(loaded, args.requests)
    torch.manual_seed(0)
    day0 = engine_for(loaded, config, "before", None).drafter
    assert day0 is not None
    samples = calibration_samples(loaded, day0, prompts, config)
    costs = {arm: frozen(samples, fit, config.k if fit == "line" else CONTEXT_K) for arm, (_, _, fit) in ARMS.items()}
    runs = {arm: ModeRun(arm, engine_for(loaded, config, arm, costs[arm])) for arm in ARMS}
    ks: dict[str, list[list[int]]] = {arm: [] for arm in ARMS}
    names = list(ARMS)
    with tqdm(total=len(items) * len(ARMS), unit="req", desc="lookahead policy") as bar:
        for number, (domain, indices) in enumerate(rounds_of(items, args.round_size)):
            shift = number % len(names)
            for arm in names[shift:] + names[:shift]:
                before = len(runs[arm].step_k)
                serve_round(runs[arm], number, domain, indices, items, prompts, config, bar)
                ks[arm].append(runs[arm].step_k[before:])
    outputs = {arm: [runs[arm].results[i].output_ids for i in range(len(items))] for arm in ARMS}
    if any(outputs[arm] != outputs["before"] for arm in ARMS):
        raise SystemExit("the arms' greedy outputs differ: verification is broken")
    summary = {arm: summarise(runs[arm], ks[arm]) for arm in ARMS}
    ratios: dict[str, dict[str, Any]] = {}
    for domain in summary["before"]:
        per_round = {arm: [{"tok_s": r["tokens"] / r["seconds"], "accept": r["tokens"] / r["passes"]}
                           for r in summary[arm][domain]["rounds"]] for arm in ARMS}
        ratios[domain] = {f"{arm}/before {field}": paired(per_round, arm, "before", field)
                          for arm in names[1:] for field in ("tok_s", "accept")}
    rows = [[arm, domain, f"{s['accept_length']:.2f}", f"{s['tokens_per_s']['median']:.1f}",
             f"{s['first_round']['accept_length']:.2f}",
             f"{s['first_round']['k0_steps']}/{s['first_round']['steps']}", f"{s['k_share'].get('0', 0):.2f}"]
            for arm in ARMS for domain, s in summary[arm].items()]
    print(markdown_table(["arm", "domain", "accept len", "tok/s (median)", "first round accept", "first round k=0",
                          "k=0 share"], rows))
    for domain, by_arm in ratios.items():
        for name, ratio in by_arm.items():
            print(f"{domain}: {name} per round median {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})")
    write_result(args.out, args, {"costs": {arm: {"draft_seconds": c.draft_seconds,
                                                  "verify_seconds": {str(k): v for k, v in c.verify_seconds.items()},
                                                  "medians": {str(k): v for k, v in c.measured_verify_seconds.items()}}
                                            for arm, c in costs.items()},
                                  "cores": sorted(os.sched_getaffinity(0)), "summary": summary,
                                  "ratios_over_before": ratios,
                                  # each arm's measured acceptance by continuation kind and chain position
                                  "chains": {arm: runs[arm].engine.lookahead.chains for arm in ARMS},
                                  "outputs_equal": True})


if __name__ == "__main__":
    main()
