"""What prefilling the chat template's opening once (`EngineConfig.shared_prefixes`) saves.

Every chat prompt the demo serves starts with the same 24 tokens (SmolLM2's system prompt and the
user turn's opening), about half of a short ShareGPT first turn. Four arms serve the same
validation chats (`demo_learner_sweep.validation_items`: ShareGPT chats the demo never serves), in
the demo's rounds of `--round-size` requests, taking turns (the order rotates by round), each
served by `specd.demo.deployment.serve_round` as the demo serves (tokens/s over the round's wall
time, prefill included):
- "none" and "none+prefix": the target alone, without and with the shared prefix;
- "static" and "static+prefix": the demo's static mode (the shipped day-0 hybrid drafter, its
  own traffic table, the lookahead controller on one calibration's frozen costs), without and with.
Per arm: tokens/s per round (median, spread), accept length, and the per-round ratios that the
demo reports (static / none) with and without the prefix, and each arm's against its own
without. HumanEval prompts are plain code with no shared opening, so they are not served here.
Greedy outputs of the four arms must be equal; the run fails otherwise. Serving is pinned as the
demo pins it. Writes out/prefix_cache.json.
"""

from __future__ import annotations

import os

import torch
from common import markdown_table, paired, parser, spread, write_result
from demo_learner_sweep import pinned_validation_traffic
from tqdm import tqdm

from specd.cli.service import CONTEXT_K
from specd.demo.deployment import DemoConfig, ModeRun, calibrated_costs, rounds_of, serve_round
from specd.drafter.factory import DrafterSpec, build_drafter, initial_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.lookahead import LookaheadCosts
from specd.model.target import LoadedTarget

ARMS = ("none", "none+prefix", "static", "static+prefix")


def engine_for(loaded: LoadedTarget, config: DemoConfig, arm: str, costs: LookaheadCosts) -> Engine:
    speculative = arm.startswith("static")
    drafter = build_drafter(config.drafter, initial_model(loaded.model, config.drafter,
                                                          fingerprint=loaded.fingerprint), version=1)
    engine = Engine(loaded.model, drafter if speculative else None,
                    EngineConfig(max_batch=config.max_batch, num_draft_tokens=config.k,
                                 eos_token_ids=loaded.eos_token_ids,
                                 shared_prefixes=loaded.shared_prefixes() if arm.endswith("+prefix") else ()))
    if speculative:
        engine.lookahead.costs = costs
    return engine


def main() -> None:
    p = parser(__doc__, "out/prefix_cache.json", repeats=None)
    p.add_argument("--requests", type=int, default=24, help="validation chats (default 24)")
    p.add_argument("--round-size", type=int, default=4, help="requests per arm per round (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64, the demo's)")
    args = p.parse_args()
    loaded = LoadedTarget.load(None)
    config = DemoConfig(max_tokens=args.max_tokens, drafter=DrafterSpec(context_k=CONTEXT_K), learning=False)
    items, prompts = pinned_validation_traffic(loaded, args.requests, ("sharegpt",))
    (opening,) = loaded.shared_prefixes()
    torch.manual_seed(0)
    day0 = build_drafter(config.drafter, initial_model(loaded.model, config.drafter, fingerprint=loaded.fingerprint),
                         version=1)
    costs = calibrated_costs(loaded, day0, prompts, config)
    runs = {arm: ModeRun(arm, engine_for(loaded, config, arm, costs)) for arm in ARMS}
    with tqdm(total=len(items) * len(ARMS), unit="req", desc="prefix cache") as bar:
        for number, (domain, indices) in enumerate(rounds_of(items, args.round_size)):
            shift = number % len(ARMS)
            for arm in ARMS[shift:] + ARMS[:shift]:
                serve_round(runs[arm], number, domain, indices, items, prompts, config, bar)
    outputs = {arm: [runs[arm].results[i].output_ids for i in range(len(items))] for arm in ARMS}
    if any(outputs[arm] != outputs["none"] for arm in ARMS):
        raise SystemExit("the arms' greedy outputs differ: verification or the prefix cache is broken")
    per_round = {arm: [{"tok_s": r["tokens"] / r["seconds"], "outside_decoding_s": r["seconds"] - r["decoding_seconds"]}
                       for r in runs[arm].rounds] for arm in ARMS}
    summary = {arm: {"tokens_per_s": spread([r["tok_s"] for r in per_round[arm]]),
                     "outside_decoding_s": spread([r["outside_decoding_s"] for r in per_round[arm]]),
                     "accept_length": sum(r["tokens"] for r in runs[arm].rounds)
                     / sum(r["target_passes"] for r in runs[arm].rounds),
                     "prefixes_copied": runs[arm].engine.prefixes.copied} for arm in ARMS}
    ratios = {name: paired(per_round, a, b, "tok_s") for name, (a, b) in {
        "static/none": ("static", "none"), "static+prefix/none+prefix": ("static+prefix", "none+prefix"),
        "none+prefix/none": ("none+prefix", "none"), "static+prefix/static": ("static+prefix", "static")}.items()}
    print(markdown_table(["arm", "tok/s (median)", "outside decoding s/round (median)", "accept len"],
                         [[arm, f"{s['tokens_per_s']['median']:.1f}", f"{s['outside_decoding_s']['median']:.2f}",
                           f"{s['accept_length']:.2f}"] for arm, s in summary.items()]))
    for name, ratio in ratios.items():
        print(f"{name}: per round median {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})")
    write_result(args.out, args, {"opening_tokens": len(opening), "prompt_tokens": [len(p) for p in prompts],
                                  "cores": sorted(os.sched_getaffinity(0)), "summary": summary,
                                  "ratios": ratios, "outputs_equal": True})


if __name__ == "__main__":
    main()
