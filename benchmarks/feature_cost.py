"""What a feature drafter's draft token costs (c) and what its pruned vocabulary covers, on SmolLM2.

c is the time of one drafting step of the feature drafter (one decoder layer at one position on
its own KV cache, its output head over the N-token draft vocabulary, argmax) over the time of one
target decode step (one token, all layers, full output head), both at context 128, batch 1 and
batch 8, timed alternately in `--repeats` rounds (median and min–max of the per-round ratios).
It is measured for every N in `--vocab` (the full vocabulary included, to show why the head must
be pruned) and every decoder-layer count in `--layers` (EAGLE-3's one, or more). Coverage: the
share of the target's own greedy output tokens, on held-out ShareGPT prompts, that fall inside
the N most frequent ids of the pretraining data (the shipped drafter's ranking); a token outside
can never be drafted. Writes out/feature_cost.json and prints a table.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import cell, markdown_table, parser, spread, write_result

from specd.core.errors import CheckpointError
from specd.core.traffic import load_sharegpt
from specd.drafter.feature_model import FeatureDrafterModel, new_feature_drafter
from specd.drafter.pretrained import SHIPPED_DRAFTER, load_pretrained
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.model.target import LoadedTarget
from specd.model.transformer import Transformer

CONTEXT = 128


def time_target(target: Transformer, batch: int, repeats: int = 10) -> float:
    cache = target.new_cache(batch, CONTEXT + 2)
    tokens = torch.randint(0, target.config.vocab_size, (batch, CONTEXT))
    target(tokens, torch.zeros(batch, dtype=torch.long), cache, logits_for="none")
    one, start = tokens[:, -1:], torch.full((batch,), CONTEXT)
    target(one, start, cache)
    begin = time.perf_counter()
    for _ in range(repeats):
        target(one, start, cache)
    return (time.perf_counter() - begin) / repeats


def time_draft_step(model: FeatureDrafterModel, batch: int, repeats: int = 10) -> float:
    hidden = model.config.hidden_size
    cache = model.new_cache(batch, CONTEXT + 2)
    states = torch.randn(batch, CONTEXT, hidden)
    tokens = torch.randint(0, model.config.vocab_size, (batch, CONTEXT))
    model.step(states, tokens, torch.zeros(batch, dtype=torch.long), cache)
    state, one, start = states[:, -1:], tokens[:, -1:], torch.full((batch,), CONTEXT)

    def draft() -> None:
        out = model.step(state, one, start, cache)
        model.draft_ids[model.logits(out).argmax(-1)]

    draft()
    begin = time.perf_counter()
    for _ in range(repeats):
        draft()
    return (time.perf_counter() - begin) / repeats


def ranking(loaded: LoadedTarget) -> tuple[torch.Tensor | None, str]:
    try:
        return load_pretrained(SHIPPED_DRAFTER, loaded.model, loaded.fingerprint).draft_ids, SHIPPED_DRAFTER.name
    except CheckpointError as error:
        return None, f"no ranking: {error}"


def coverage(loaded: LoadedTarget, ranked: torch.Tensor, sizes: list[int], prompts: int, tokens: int) -> dict:
    items = load_sharegpt(prompts, seed=5)
    encoded = [loaded.encode_messages([{"role": r, "content": c} for r, c in item.messages or ()]) for item in items]
    engine = Engine(loaded.model, None, EngineConfig(max_batch=8, eos_token_ids=loaded.eos_token_ids))
    outputs = [t for seq in engine.generate(encoded, SamplingParams(max_tokens=tokens)) for t in seq.output_ids]
    result = {}
    for n in sizes:
        if n <= len(ranked):
            inside = set(ranked[:n].tolist())
            result[str(n)] = sum(t in inside for t in outputs) / len(outputs)
    return {"output_tokens": len(outputs), "share_inside": result}


def main() -> None:
    p = parser(__doc__, "out/feature_cost.json", repeats=5)
    p.add_argument("--vocab", default="4096,8192,16384,49152", help="draft vocabulary sizes to time")
    p.add_argument("--layers", default="1", help="drafter decoder-layer counts to time")
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts for the coverage")
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = LoadedTarget.load()
    target = loaded.model
    sizes = [min(int(n), target.config.vocab_size) for n in args.vocab.split(",")]
    result: dict[str, Any] = {"context": CONTEXT, "torch_threads": 1, "c": {}}
    with torch.inference_mode():
        for n, layers in [(n, int(layers)) for n in sizes for layers in args.layers.split(",")]:
            model = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                        torch.arange(n), num_layers=layers).eval()
            shape = f"N={n}" if layers == 1 else f"N={n} layers={layers}"
            for batch in (1, 8):
                ratios, target_ms, draft_ms = [], [], []
                for _ in range(args.repeats):
                    t, d = time_target(target, batch), time_draft_step(model, batch)
                    ratios.append(d / t)
                    target_ms.append(t * 1e3)
                    draft_ms.append(d * 1e3)
                result["c"][f"{shape} batch={batch}"] = {"c": spread(ratios), "target_ms": statistics.median(target_ms),
                                                       "draft_ms": statistics.median(draft_ms)}
    ranked, source = ranking(loaded)
    result["ranking"] = source
    if ranked is not None:
        result["coverage"] = coverage(loaded, ranked, sizes, args.prompts, args.tokens)
    path = write_result(args.out, args, result)
    print(markdown(result, path.parent))


def markdown(result: dict[str, Any], out: Path) -> str:
    """The tables the report shows: c per draft vocabulary and batch, then the coverage."""
    rows = [[name, cell(row["c"], 3), f"{row['draft_ms']:.2f}", f"{row['target_ms']:.2f}"]
            for name, row in result["c"].items()]
    text = markdown_table(["draft vocabulary, batch", "c (median, min–max)", "draft step ms", "target step ms"], rows)
    if "coverage" in result:
        share = result["coverage"]["share_inside"]
        text += "\n\n" + markdown_table(["N", "target output tokens inside the draft vocabulary"],
                                         [[n, f"{v:.1%}"] for n, v in share.items()])
    return text + "\n"

if __name__ == "__main__":
    main()
