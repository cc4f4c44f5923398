"""Decode speed of the engine on SmolLM2-135M, side by side in one run.

For each dtype (float32, bfloat16) and batch (1, 4), on chat prompts with 128 new tokens
(EOS ignored so every configuration decodes the same number of tokens):
- transformers `generate` (greedy, static-length), the reference the engine must not trail;
- specd target-only;
- specd + replay drafter at k = 4 (accept length 5 at zero drafting cost: the engine's best case);
- specd + a random token drafter at k = 4 (the worst case: every draft rejected);
- the same random drafter with the adaptive lookahead controller (k chosen per step: the floor).
Next to each speedup: the drafter/target cost ratio c and the analytic bound
(1 − α^(k+1)) / ((1 − α)(k·c + 1)). Writes JSON (default out/engine_speed.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.replay import record_greedy
from specd.engine.request import SamplingParams
from specd.model.target import LoadedTarget
from specd.model.transformer import Transformer

CHATS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works to a ten-year-old.",
    "What are the pros and cons of remote work? Give a balanced answer.",
    "Describe a relaxing weekend in the mountains.",
]


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


def run_hf(hf_model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    begin = time.perf_counter()
    out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=pad_id)
    seconds = time.perf_counter() - begin
    return seconds, [row[width:].tolist() for row in out]


def run_specd(target: Transformer, drafter, prompts: list[list[int]], new_tokens: int, k: int,
              adaptive_k: bool = False) -> dict:
    engine = Engine(target, drafter, EngineConfig(max_batch=len(prompts), num_draft_tokens=k,
                                                  adaptive_lookahead=adaptive_k))
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    begin = time.perf_counter()
    seqs = engine.generate(prompts, params)
    seconds = time.perf_counter() - begin
    proposed = sum(s.num_drafts_proposed for s in seqs)
    return {"seconds": seconds, "tokens_per_s": sum(s.num_output_tokens for s in seqs) / seconds,
            "accept_length": sum(s.num_output_tokens for s in seqs) / sum(s.num_target_passes for s in seqs),
            "acceptance_rate": sum(s.num_drafts_accepted for s in seqs) / proposed if proposed else 0.0,
            "outputs": [s.output_ids for s in seqs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of transformers vs target-only")
    parser.add_argument("--out", default="out/engine_speed.json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    from transformers import AutoModelForCausalLM

    rows = []
    for dtype in args.dtypes:
        loaded = LoadedTarget.load(None, dtype)
        target = loaded.model
        hf_model = AutoModelForCausalLM.from_pretrained(str(loaded.folder), dtype=getattr(torch, dtype)).eval()
        prompts_all = [loaded.encode(c, chat=True) for c in CHATS]
        drafter_model = new_drafter_model(target, DrafterShape.like(target.config))
        c = time_single_token(drafter_model) / time_single_token(target)
        for batch in args.batches:
            prompts = prompts_all[:batch]
            run_specd(target, None, prompts, 8, 0)  # warm-up
            run_hf(hf_model, prompts, 8, loaded.tokenizer.pad_token_id or 0)
            # the engine-vs-transformers ratio is the noisiest figure: interleave the two, take medians
            hf_runs, base_runs = [], []
            for _ in range(args.repeats):
                hf_runs.append(run_hf(hf_model, prompts, args.new_tokens, loaded.tokenizer.pad_token_id or 0))
                base_runs.append(run_specd(target, None, prompts, args.new_tokens, 0))
            hf_seconds, hf_out = sorted(hf_runs, key=lambda run: run[0])[len(hf_runs) // 2]
            hf_tps = batch * args.new_tokens / hf_seconds
            base = sorted(base_runs, key=lambda run: run["seconds"])[len(base_runs) // 2]
            replay = record_greedy(target, prompts, args.new_tokens, (), max_batch=batch)
            configs = {"specd target-only": (base, 0.0),
                       "specd replay k=4": (run_specd(target, replay, prompts, args.new_tokens, args.k), 0.0),
                       "specd random k=4": (run_specd(target, TokenDrafter(drafter_model), prompts,
                                                      args.new_tokens, args.k), c),
                       "specd random adaptive k": (run_specd(target, TokenDrafter(drafter_model), prompts,
                                                             args.new_tokens, args.k, adaptive_k=True), c)}
            rows.append({"dtype": dtype, "batch": batch, "config": "transformers generate",
                         "tokens_per_s": hf_tps, "speedup_vs_target_only": hf_tps / base["tokens_per_s"],
                         "same_tokens_as_specd_target_only": hf_out == base["outputs"]})
            for name, (result, cost) in configs.items():
                alpha = result["acceptance_rate"]
                rows.append({
                    "dtype": dtype, "batch": batch, "config": name, "tokens_per_s": result["tokens_per_s"],
                    "speedup_vs_target_only": result["tokens_per_s"] / base["tokens_per_s"],
                    "speedup_vs_transformers": result["tokens_per_s"] / hf_tps,
                    "accept_length": result["accept_length"], "acceptance_rate": alpha,
                    "cost_ratio_c": cost if name != "specd target-only" else None,
                    "analytic_bound": speedup_bound(alpha, args.k, cost) if name != "specd target-only" else None,
                    "rows_identical_to_target_only": sum(o == b for o, b in zip(result["outputs"], base["outputs"],
                                                                                 strict=True)),
                    "rows": batch})
            for row in rows[-5:]:
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"new_tokens": args.new_tokens, "k": args.k,
                                          "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(f"\n{'dtype':9} {'batch':>5}  {'config':24} {'tok/s':>7} {'vs target-only':>14} "
          f"{'accept len':>10} {'c':>6} {'bound':>6}")
    for r in rows:
        print(f"{r['dtype']:9} {r['batch']:>5}  {r['config']:24} {r['tokens_per_s']:7.1f} "
              f"{r['speedup_vs_target_only']:14.2f} {r.get('accept_length') or 0:10.2f} "
              f"{r.get('cost_ratio_c') or 0:6.3f} {r.get('analytic_bound') or 0:6.2f}")


if __name__ == "__main__":
    main()
