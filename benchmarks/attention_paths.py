"""Attention over the KV cache: torch's CPU flash kernel against `attend_few`'s two matmuls.

Two parts, each in interleaved rounds:
- per layer: one attention call on SmolLM2's head shape (9 query heads, 3 key heads, 64 wide)
  for the shapes the engine runs: bulk generation (batch 64, one query per row, bfloat16),
  serving verification and decoding (batch 4, k + 1 = 5 or 1 queries, float32), a prefill chunk
  (48 queries, float32), with each path's time and its largest difference from the kernel;
- end to end: the self-distillation stage (`generate_examples`, the first `--prompts` training
  prompts, batch 64, bfloat16, the recipe's sampling) with `FEW_QUERIES` at 0 (the kernel for
  every call, as before) and at its default, new tokens per second and the per-round ratio.
Writes out/attention_paths.json.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from common import cell, interleaved, markdown_table, paired, parser, spread, write_result

import specd.model.transformer as transformer
from specd.model.target import LoadedTarget
from specd.offline.distill import DistillConfig, generate_examples, iter_training_prompts

CAPTURE = (2, 15, 27, 29)
DEFAULT_FEW_QUERIES = transformer.FEW_QUERIES
# (name, dtype, batch, queries per row, cached positions)
SHAPES = [("generation", torch.bfloat16, 64, 1, 300), ("verification", torch.float32, 4, 5, 300),
          ("decoding", torch.float32, 4, 1, 300), ("prefill chunk", torch.float32, 1, 48, 1000)]


def one_layer(dtype: torch.dtype, batch: int, queries: int, cached: int, repeats: int = 30) -> dict[str, Any]:
    torch.manual_seed(0)
    q = torch.randn(batch, 9, queries, 64, dtype=dtype)
    # a slice of a longer static cache, as the engine reads it
    keys = torch.randn(batch, 3, 2 * cached, 64, dtype=dtype)[:, :, :cached]
    values = torch.randn(batch, 3, 2 * cached, 64, dtype=dtype)[:, :, :cached]
    positions = cached - queries + torch.arange(queries)
    mask = (torch.arange(cached) <= positions[:, None]).expand(batch, 1, queries, cached)
    paths = {"kernel": lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True),
             "attend_few": lambda: transformer.attend_few(q, keys, values, mask)}
    figures: dict[str, Any] = {}
    for name, call in paths.items():
        for _ in range(3):
            call()
        begin = time.perf_counter()
        for _ in range(repeats):
            call()
        figures[f"{name}_ms"] = (time.perf_counter() - begin) / repeats * 1e3
    figures["max_difference"] = float((paths["kernel"]().float() - paths["attend_few"]().float()).abs().max())
    return figures


def generation(loaded: LoadedTarget, prompts: list, few_queries: int) -> dict[str, Any]:
    transformer.FEW_QUERIES = few_queries
    try:
        begin = time.perf_counter()
        examples = generate_examples(loaded, prompts, 0, DistillConfig(batch=64, dtype="bfloat16"), CAPTURE)
        seconds = time.perf_counter() - begin
    finally:
        transformer.FEW_QUERIES = DEFAULT_FEW_QUERIES
    new = sum(len(e.tokens) - e.prompt_length for e in examples)
    return {"new_tokens": new, "seconds": seconds, "tokens_per_s": new / seconds}


def main() -> int:
    p = parser(__doc__, "out/attention_paths.json", repeats=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    layer_runs = interleaved({name: (lambda _r, shape=(dtype, batch, queries, cached): one_layer(*shape))
                              for name, dtype, batch, queries, cached in SHAPES}, args.repeats, label="layer ")
    layers = {name: {field: spread([r[field] for r in runs]) for field in ("kernel_ms", "attend_few_ms")}
              | {"max_difference": max(r["max_difference"] for r in runs)} for name, runs in layer_runs.items()}
    prompts = list(iter_training_prompts(LoadedTarget.load(), 320, 1, limit=args.prompts))
    loaded = LoadedTarget.load(dtype="bfloat16")
    runs = interleaved({"kernel": lambda _r: generation(loaded, prompts, 0),
                        "attend_few": lambda _r: generation(loaded, prompts, DEFAULT_FEW_QUERIES)},
                       args.repeats, label="generation ")
    speed = {name: spread([r["tokens_per_s"] for r in rs]) for name, rs in runs.items()}
    ratio = paired(runs, "attend_few", "kernel", "tokens_per_s")
    layer_table = markdown_table(
        ["shape", "kernel ms", "attend_few ms", "largest difference"],
        [[f"{name}: {str(dtype).removeprefix('torch.')}, batch {batch}, {queries} queries, {cached} cached",
          cell(layers[name]["kernel_ms"], 3), cell(layers[name]["attend_few_ms"], 3),
          f"{layers[name]['max_difference']:.1e}"] for name, dtype, batch, queries, cached in SHAPES])
    generation_table = markdown_table(
        ["attention", "new tokens/s", "attend_few / kernel"],
        [["kernel for every call", cell(speed["kernel"], 0), ""],
         [f"attend_few up to {DEFAULT_FEW_QUERIES} queries", cell(speed["attend_few"], 0), cell(ratio, 2)]])
    write_result(args.out, args, {"layers": layers, "layer_runs": layer_runs, "generation_runs": runs,
                                  "generation_tokens_per_s": speed, "generation_ratio": ratio,
                                  "tables": [layer_table, generation_table]})
    print(layer_table, generation_table, sep="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
