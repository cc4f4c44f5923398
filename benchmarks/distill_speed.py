"""Bulk generation for self-distillation: specd's engine against vLLM offline, tokens/s.

The same training prompts (the first `--prompts` of `specd.offline.distill.iter_training_prompts`)
answered greedily with up to 128 new tokens, by: specd's engine with the distillation stage's
feature capture (the features every training example needs come from the same passes) at batch
32 and 64 in float32 and bfloat16; and vLLM's offline `LLM.generate` (eager, bfloat16, batch 64),
which returns tokens only, so its examples would still need one feature pass each (timed too, with
specd's target in bfloat16, batched by example). Configurations run in interleaved rounds.
Writes out/distill_speed.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
from common import interleaved, markdown_table, parser, spread, write_result

from specd.model.target import LoadedTarget
from specd.offline.distill import DistillConfig, generate_examples, iter_training_prompts

CAPTURE = (2, 15, 27, 29)


def specd_run(prompts: list, dtype: str, batch: int) -> dict[str, Any]:
    loaded = LoadedTarget.load(dtype=dtype)
    config = DistillConfig(batch=batch, dtype=dtype)
    begin = time.perf_counter()
    examples = generate_examples(loaded, prompts, 0, config, CAPTURE)
    seconds = time.perf_counter() - begin
    new = sum(len(e.tokens) - e.prompt_length for e in examples)
    return {"new_tokens": new, "seconds": seconds, "tokens_per_s": new / seconds}


def vllm_run(prompts: list, batch: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams, TokensPrompt

    from specd.model.bundled import bundled_target_dir

    # on the CPU backend the memory fraction is what vLLM reserves of the node's memory for its KV cache:
    # 64 rows of 512 tokens need little, and the default (0.92) fails beside this process's own targets
    llm = LLM(model=str(bundled_target_dir()), dtype="bfloat16", max_model_len=512, enforce_eager=True,
              max_num_seqs=batch, gpu_memory_utilization=0.3)
    begin = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p.ids) for p in prompts],
                           SamplingParams(temperature=0, max_tokens=128))
    seconds = time.perf_counter() - begin
    new = sum(len(o.outputs[0].token_ids) for o in outputs)
    # the features vLLM does not return: one bf16 pass per example with specd's target
    loaded = LoadedTarget.load(dtype="bfloat16")
    begin = time.perf_counter()
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs, strict=True):
            tokens = torch.tensor([*prompt.ids, *output.outputs[0].token_ids])
            loaded.model.train_features(tokens[None], CAPTURE)
    feature_seconds = time.perf_counter() - begin
    del llm
    return {"new_tokens": new, "seconds": seconds, "tokens_per_s": new / seconds,
            "feature_seconds": feature_seconds, "tokens_per_s_with_features": new / (seconds + feature_seconds)}


def main() -> int:
    p = parser(__doc__, "out/distill_speed.json", repeats=1)
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--no-vllm", action="store_true")
    args = p.parse_args()
    prompts = list(iter_training_prompts(LoadedTarget.load(), 320, 1, limit=args.prompts))
    configs = {f"specd {dtype} batch {batch}": (lambda _r, d=dtype, b=batch: specd_run(prompts, d, b))
               for dtype in ("float32", "bfloat16") for batch in (32, 64)}
    if not args.no_vllm:
        configs["vLLM offline bfloat16 batch 64"] = lambda _r: vllm_run(prompts, 64)
    runs = interleaved(configs, args.repeats)
    figures = {name: spread([r["tokens_per_s"] for r in runs[name]]) for name in configs}
    rows = [[name, f"{figures[name]['median']:.0f}",
             f"{statistics.median(r['tokens_per_s_with_features'] for r in runs[name]):.0f}"
             if "tokens_per_s_with_features" in runs[name][0] else "same pass"] for name in configs]
    table = markdown_table(["engine", "new tokens/s", "with the features training needs"], rows)
    write_result(args.out, args, {"prompts": len(prompts), "runs": runs, "tokens_per_s": figures, "table": table})
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
