"""What fp16 drafter weights and the drafter's layer in C buy a batch-1 engine: drafting time, decode
speed, accept length.

The shipped feature drafter serves validation traffic (the first turns of ShareGPT conversations in
`traffic.VALIDATION_RANGE` and HumanEval problems the demo never serves, from `--humaneval-from`
on), greedy, batch 1, one thread (the demo's serving thread), k fixed at each of `--ks` (the
lookahead controller would choose k by measured times, and so differently per arm), with the default
hybrid drafter (context matches, a traffic table fed by each finished request) or the learned
drafter alone (`--kind learned`). Arms (`--arms`): the drafter's linear layers through specd's
kernel in fp16 (`half`, the default) and in float32 (`float32`, `packed_linear._HALF_WEIGHTS` off),
and `half-noskip`: fp16 with the hybrid running its learned drafter at every step, also where
continuations serve the row (`HybridDrafter.skip_covered_steps` off; the default skips those steps),
and `half-torch`: fp16 with the drafter's layer through torch's operations instead of one C call
(`specd.model.fused_layer` off, `SPECD_FUSED_LAYER=0`); each at every k, in `--repeats` interleaved
rounds. With `--perturb EPS` each arm also serves a copy of the drafter whose weights were scaled by
1 + EPS * N(0, 1) (float32 values no longer exact in fp16, as a learner's versions are), to show
what rounding them costs in accept length. Per arm: tokens/s over decoding steps, the learned
drafter's proposal time per call, per decoding step (a skipped step counts as none) and per drafted
position, accept length; per-round ratios of `half` to each other arm. Greedy outputs must equal the
first arm's (verification keeps them so); the run fails otherwise. Writes
out/drafter_half_weights.json.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from common import cell, markdown_table, paired, parser, spread, write_result
from hybrid_policy import traffic

from specd.drafter.factory import DrafterSpec, build_drafter, initial_model
from specd.drafter.feature_model import FeatureDrafterModel
from specd.drafter.hybrid import HybridDrafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.model import packed_linear
from specd.model.target import LoadedTarget


def validation_prompts(loaded: LoadedTarget, requests: int, humaneval_from: int) -> list[list[int]]:
    """Half chat, half code (`hybrid_policy.traffic`'s validation prompts), never the demo's traffic."""
    by_domain = traffic(loaded, requests - requests // 2, humaneval_from)
    return by_domain["sharegpt"] + by_domain["humaneval"][:requests // 2]


def perturbed(model: FeatureDrafterModel, eps: float, seed: int = 0) -> FeatureDrafterModel:
    twin = model.clone()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in twin.parameters():
            param.mul_(1 + eps * torch.randn(param.shape, generator=generator))
    return twin


# name -> (fp16, skip covered steps, the layer in C)
ARMS = {"half": (True, True, True), "float32": (False, True, True), "half-noskip": (True, False, True),
        "half-torch": (True, True, False)}


def serve(loaded: LoadedTarget, model: FeatureDrafterModel, kind: str, arm: str, k: int,
          prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, Any], list[list[int]]]:
    half, skip, fused = ARMS[arm]
    packed_linear._HALF_WEIGHTS = half
    os.environ["SPECD_FUSED_LAYER"] = "1" if fused else "0"
    drafter = build_drafter(DrafterSpec(kind=kind, arch="feature"), model, 1)
    if isinstance(drafter, HybridDrafter):
        drafter.skip_covered_steps = skip
    learned = getattr(drafter, "learned", drafter)
    proposing = {"seconds": 0.0, "calls": 0, "positions": 0}
    propose = learned.propose

    def timed(batch: Any, k: int) -> Any:
        begin = time.perf_counter()
        proposal = propose(batch, k)
        proposing["seconds"] += time.perf_counter() - begin
        proposing["calls"] += 1
        proposing["positions"] += proposal.drafts.shape[1]
        return proposal

    learned.propose = timed
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=1, num_draft_tokens=k, adaptive_lookahead=False,
                                                        eos_token_ids=loaded.eos_token_ids))
    table = getattr(drafter, "table", None)
    outputs, decoding, passes, steps = [], 0.0, 0, 0
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
        while engine.has_work:
            before = engine.step_stats[-1] if engine.step_stats else None
            for seq in engine.step():
                outputs.append(seq.output_ids)
                passes += seq.num_target_passes
                if table is not None:
                    table.add(seq.prompt_ids + seq.output_ids)
            if engine.step_stats and engine.step_stats[-1] is not before:
                decoding += engine.step_stats[-1].seconds
                steps += 1
    tokens = sum(map(len, outputs))
    return {"tokens_per_s": tokens / decoding, "decoding_s": decoding, "accept_length": tokens / max(passes, 1),
            "propose_ms_per_call": 1e3 * proposing["seconds"] / max(proposing["calls"], 1),
            "propose_ms_per_step": 1e3 * proposing["seconds"] / max(steps, 1),
            "propose_ms_per_position": 1e3 * proposing["seconds"] / max(proposing["positions"], 1),
            "propose_calls": proposing["calls"]}, outputs


def main() -> None:
    p = parser(__doc__, "out/drafter_half_weights.json", repeats=5)
    p.add_argument("--requests", type=int, default=12, help="requests per run (half chat, half code)")
    p.add_argument("--humaneval-from", type=int, default=40,
                   help="first HumanEval problem used (the demo serves and holds out the first 28)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ks", default="2,3", help="fixed k per arm, comma-separated")
    p.add_argument("--kind", choices=("hybrid", "learned"), default="hybrid")
    p.add_argument("--perturb", type=float, default=0.0, help="also serve a perturbed float32 copy (0: not)")
    p.add_argument("--arms", default="half,float32", help=f"comma-separated, of {', '.join(ARMS)}")
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = LoadedTarget.load()
    shipped = initial_model(loaded.model, DrafterSpec(kind=args.kind, arch="feature", pretrained=True),
                            fingerprint=loaded.fingerprint)
    assert isinstance(shipped, FeatureDrafterModel)
    models = {"shipped": shipped, **({"perturbed": perturbed(shipped, args.perturb)} if args.perturb else {})}
    prompts = validation_prompts(loaded, args.requests, args.humaneval_from)
    wanted = args.arms.split(",")
    if not set(wanted) <= set(ARMS):
        raise SystemExit(f"--arms: choose from {', '.join(ARMS)}")
    arms = [(name, arm, k) for name in models for k in map(int, args.ks.split(",")) for arm in wanted]
    runs: dict[str, list[dict[str, Any]]] = {}
    reference = None
    try:
        for round_number in range(args.repeats):
            shift = round_number % len(arms)
            for name, arm, k in arms[shift:] + arms[:shift]:
                label = f"{name} k={k} {arm}"
                figures, outputs = serve(loaded, models[name], args.kind, arm, k, prompts, args.max_tokens)
                if reference is None:
                    reference = outputs
                elif outputs != reference:
                    raise SystemExit(f"{label}: greedy outputs differ from the first arm's")
                runs.setdefault(label, []).append({**figures, "round": round_number})
                print(f"round {round_number + 1}/{args.repeats} {label}: {figures['tokens_per_s']:.1f} tok/s, "
                      f"propose {figures['propose_ms_per_call']:.2f} ms, accept {figures['accept_length']:.3f}",
                      flush=True)
    finally:
        packed_linear._HALF_WEIGHTS = True
        os.environ.pop("SPECD_FUSED_LAYER", None)
    fields = ("tokens_per_s", "propose_ms_per_call", "propose_ms_per_step", "propose_ms_per_position", "accept_length")
    summary = {label: {f: spread([r[f] for r in rs]) for f in fields} for label, rs in runs.items()}
    ratios: dict[str, dict[str, Any]] = {}
    for name, arm, k in arms:
        if arm != "half" and "half" in wanted:
            ratios[f"{name} k={k}: half / {arm}"] = {f: paired(runs, f"{name} k={k} half", f"{name} k={k} {arm}", f)
                                                     for f in fields}
    write_result(args.out, args, {"runs": runs, "summary": summary, "ratios": ratios,
                                  "kernel_reads_half": bool(packed_linear.row_kernel()
                                                            and packed_linear.row_kernel().has_half)})
    rows = [[label, cell(s["tokens_per_s"]), cell(s["propose_ms_per_call"], 2), cell(s["propose_ms_per_step"], 2),
             cell(s["accept_length"], 3)] for label, s in summary.items()]
    print(markdown_table(["arm", "tokens/s", "propose ms a call", "propose ms a step", "accept length"], rows))
    for label, r in ratios.items():
        print(f"{label}: tokens/s {cell(r['tokens_per_s'], 3)}, proposal a step {cell(r['propose_ms_per_step'], 3)}")


if __name__ == "__main__":
    main()
