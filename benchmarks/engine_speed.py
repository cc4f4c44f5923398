"""Decode speed of the engine on SmolLM2-135M: configurations interleaved, medians and spread.

For each dtype (float32, bfloat16) and batch (1, 4), on chat prompts with `--new-tokens` new
tokens (EOS ignored so every configuration decodes the same number of tokens), these run in
`--repeats` interleaved rounds (A B C D E, B C D E A, ...):
- transformers `generate` (greedy, static-length), the reference the engine must not trail;
- specd target-only;
- specd + replay drafter at k (accept length k + 1 at zero drafting cost: the engine's best case);
- specd + a random token drafter at k (the worst case: every draft rejected);
- the same random drafter with the adaptive lookahead controller (k chosen per step: the floor).
Tokens are counted as the token ids each run returned. Per configuration: tokens/s (median,
min–max), the per-round ratio to target-only, accept length, acceptance rate, how many rows equal
target-only's tokens, the drafter/target cost ratio c (median of interleaved single-token timings)
and the analytic bound (1 − α^(k+1)) / ((1 − α)(k·c + 1)) at the median acceptance rate α.
Writes JSON (default out/engine_speed.json) with every run and the provenance, and prints a table.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import cell, dot_plot, field_spreads, interleaved, markdown_table, paired, parser, write_result

from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.greedy_recording import record_greedy
from specd.engine.request import SamplingParams
from specd.model.target import LoadedTarget
from specd.model.transformer import Transformer

CHATS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works to a ten-year-old.",
    "What are the pros and cons of remote work? Give a balanced answer.",
    "Describe a relaxing weekend in the mountains.",
]
BASE = "specd target-only"
FIELDS = ("tokens_per_s", "accept_length", "acceptance_rate", "rows_identical_to_target_only")


def speedup_bound(alpha: float, k: int, c: float) -> float:
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def time_single_token(model: Transformer, context: int = 128, repeats: int = 20) -> float:
    """Seconds for one decode forward of one token at position `context`, batch 1."""
    cache = model.new_cache(1, context + 2)
    tokens = torch.randint(0, model.config.vocab_size, (1, context))
    model(tokens, torch.tensor([0]), cache, logits_for="none")
    one = tokens[:, -1:]
    model(one, torch.tensor([context]), cache)
    begin = time.perf_counter()
    for _ in range(repeats):
        model(one, torch.tensor([context]), cache)
    return (time.perf_counter() - begin) / repeats


def cost_ratio(drafter: Transformer, target: Transformer, repeats: int) -> float:
    """Drafter/target cost of one token, the two timed alternately, median of the ratios."""
    return statistics.median(time_single_token(drafter) / time_single_token(target) for _ in range(max(repeats, 3)))


def run_hf(hf_model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> dict[str, Any]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    begin = time.perf_counter()
    out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=pad_id)
    seconds = time.perf_counter() - begin
    outputs = [row[width:].tolist() for row in out]
    return {"seconds": seconds, "tokens": sum(map(len, outputs)),
            "tokens_per_s": sum(map(len, outputs)) / seconds, "outputs": outputs}


def run_specd(target: Transformer, make_drafter: Any, prompts: list[list[int]], new_tokens: int, k: int,
              adaptive_k: bool = False) -> dict[str, Any]:
    engine = Engine(target, make_drafter(), EngineConfig(max_batch=len(prompts), num_draft_tokens=k,
                                                         adaptive_lookahead=adaptive_k))
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    begin = time.perf_counter()
    seqs = engine.generate(prompts, params)
    seconds = time.perf_counter() - begin
    tokens = sum(s.num_output_tokens for s in seqs)
    proposed = sum(s.num_drafts_proposed for s in seqs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "accept_length": tokens / sum(s.num_target_passes for s in seqs),
            "acceptance_rate": sum(s.num_drafts_accepted for s in seqs) / proposed if proposed else None,
            "outputs": [s.output_ids for s in seqs]}


def measure_group(loaded: LoadedTarget, hf_model: Any, drafter_model: Transformer, batch: int,
                  args: Any) -> dict[str, Any]:
    target, k, n = loaded.model, args.k, args.new_tokens
    prompts = [loaded.encode(c, chat=True) for c in CHATS][:batch]
    pad = loaded.tokenizer.pad_token_id or 0
    run_specd(target, lambda: None, prompts, 8, 0)  # warm-up
    run_hf(hf_model, prompts, 8, pad)
    replay = record_greedy(target, prompts, n, (), max_batch=batch)

    def specd(make_drafter: Any, k: int, adaptive_k: bool = False) -> Any:
        return lambda _round: run_specd(target, make_drafter, prompts, n, k, adaptive_k)

    configs = {"transformers generate": lambda _round: run_hf(hf_model, prompts, n, pad),
               BASE: specd(lambda: None, 0),
               f"specd replay k={k}": specd(lambda: replay, k),
               f"specd random k={k}": specd(lambda: TokenDrafter(drafter_model), k),
               "specd random adaptive k": specd(lambda: TokenDrafter(drafter_model), k, adaptive_k=True)}
    runs = interleaved(configs, args.repeats, label=f"{loaded.model.embed.weight.dtype} b{batch} ")
    reference = runs[BASE][0]["outputs"]
    for rs in runs.values():
        for r in rs:
            r["rows_identical_to_target_only"] = sum(a == b for a, b in zip(r.pop("outputs"), reference, strict=True))
    return {"batch": batch, "rows": batch, "runs": runs, "summary": field_spreads(runs, FIELDS),
            "speedup_vs_target_only": {name: paired(runs, name, BASE, "tokens_per_s") for name in runs}}


def main() -> None:
    p = parser(__doc__, "out/engine_speed.json", repeats=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    p.add_argument("-k", type=int, default=4)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    from transformers import AutoModelForCausalLM

    groups = []
    for dtype in args.dtypes:
        loaded = LoadedTarget.load(None, dtype)
        hf_model = AutoModelForCausalLM.from_pretrained(str(loaded.folder), dtype=getattr(torch, dtype)).eval()
        drafter_model = new_drafter_model(loaded.model, DrafterShape.like(loaded.model.config))
        c = cost_ratio(drafter_model, loaded.model, args.repeats)
        for batch in args.batches:
            group = measure_group(loaded, hf_model, drafter_model, batch, args)
            group.update(dtype=dtype, cost_ratio_c=c)
            for row in group["summary"].values():
                alpha = row["acceptance_rate"]["median"]
                row["analytic_bound"] = speedup_bound(alpha, args.k, c) if alpha is not None else None
            groups.append(group)
    result = {"k": args.k, "new_tokens": args.new_tokens, "groups": groups}
    write_result(args.out, args, result)
    print(markdown(result, Path(args.out).parent))


def markdown(result: dict[str, Any], out: Path) -> str:
    """The report's section: one table row per dtype, batch and configuration; a dot plot of tokens/s."""
    rows = []
    for g in result["groups"]:
        for name, s in g["summary"].items():
            bound = s.get("analytic_bound")
            rows.append([g["dtype"], g["batch"], name, cell(s["tokens_per_s"]),
                         cell(g["speedup_vs_target_only"][name], 2), cell(s["accept_length"], 2),
                         cell(s["acceptance_rate"], 2),
                         f"{g['cost_ratio_c']:.3f}" if "random" in name else "–",
                         f"{bound:.2f}" if bound is not None and "random" in name else "–",
                         f"{s['rows_identical_to_target_only']['min']:.0f} of {g['rows']}"])
    text = markdown_table(["dtype", "batch", "config", "tokens/s", "× target-only (per round)", "accept len",
                           "acceptance", "c", "bound", "rows = target-only (worst run)"], rows)
    groups = {f"{g['dtype']} batch {g['batch']}": {name: [r["tokens_per_s"] for r in rs]
                                                   for name, rs in g["runs"].items()} for g in result["groups"]}
    path = dot_plot(groups, "engine decode speed (each dot one run)", "tokens/s", out / "engine_speed.png")
    text += f"\n\n![engine speed]({path.name})"
    return text


if __name__ == "__main__":
    main()
