"""What a target pass costs by rows and tokens a row: oneDNN-packed linear layers against MKL's.

The bundled SmolLM2-135M in float32, one thread (the demo's serving thread), after a 300-token
prefill of every cache slot: a pass over B rows of T new tokens each (B = 1, 2, 4, 8; T = 1..5,
a verification pass at k = T − 1), with `PackedLinear`'s packing on and off, in `--repeats`
interleaved rounds (each round times every cell in both settings, 3 passes a timing). Per cell: the
median and spread of the milliseconds a pass, the ratio off / on, and the cost of each T relative to
T = 1 in the same setting (what drafting must beat). Also checks that both settings pick the same
argmax at every position of a B = 4, T = 5 pass. Writes JSON (default out/target_pass_cost.json)
and prints a table.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from common import cell, markdown_table, parser, spread, write_result

from specd.model import packed_linear
from specd.model.target import LoadedTarget

BATCHES = (1, 2, 4, 8)
TOKENS = (1, 2, 3, 4, 5)
CACHED = 300
SETTINGS = {"packed": True, "plain": False}


def _time_pass(model: torch.nn.Module, cache: Any, batch: int, tokens: int, passes: int = 3) -> float:
    new = torch.randint(0, 40000, (batch, tokens))
    start = torch.full((batch,), CACHED, dtype=torch.long)
    begin = time.perf_counter()
    for _ in range(passes):
        model(new, start, cache, logits_for="all")
    return (time.perf_counter() - begin) / passes * 1000


def _same_argmax(model: torch.nn.Module, cache: Any) -> bool:
    probe = torch.randint(0, 40000, (4, 5), generator=torch.Generator().manual_seed(0))
    start = torch.full((4,), CACHED, dtype=torch.long)
    picks = []
    for packing in SETTINGS.values():
        packed_linear._PACKING = packing
        logits, _ = model(probe, start, cache, logits_for="all")
        picks.append(logits.argmax(-1))
    return bool(torch.equal(picks[0], picks[1]))


def main() -> None:
    args = parser(__doc__, "out/target_pass_cost.json", 7).parse_args()
    torch.set_num_threads(1)
    model = LoadedTarget.load().model.eval()
    cache = model.new_cache(max(BATCHES), CACHED + 16)
    times: dict[str, dict[tuple[int, int], list[float]]] = {name: {} for name in SETTINGS}
    with torch.inference_mode():
        model(torch.randint(0, 40000, (max(BATCHES), CACHED)), torch.zeros(max(BATCHES), dtype=torch.long), cache,
              logits_for="none")
        same = _same_argmax(model, cache)
        for round_number in range(args.repeats):
            order = list(SETTINGS.items()) if round_number % 2 == 0 else list(SETTINGS.items())[::-1]
            for name, packing in order:
                packed_linear._PACKING = packing
                _time_pass(model, cache, 1, 1, passes=1)  # the first packed call packs
                for batch in BATCHES:
                    for tokens in TOKENS:
                        times[name].setdefault((batch, tokens), []).append(_time_pass(model, cache, batch, tokens))
            print(f"  round {round_number + 1}/{args.repeats}", flush=True)
    packed_linear._PACKING = packed_linear.packing_enabled()
    cells = []
    for batch in BATCHES:
        for tokens in TOKENS:
            entry: dict[str, Any] = {"batch": batch, "tokens_per_row": tokens}
            for name in SETTINGS:
                entry[f"{name}_ms"] = spread(times[name][(batch, tokens)])
                entry[f"{name}_vs_one_token"] = (entry[f"{name}_ms"]["median"]
                                                 / statistics.median(times[name][(batch, 1)]))
            entry["plain_over_packed"] = spread([p / q for p, q in zip(times["plain"][(batch, tokens)],
                                                                      times["packed"][(batch, tokens)], strict=True)])
            cells.append(entry)
    rows = [[c["batch"], c["tokens_per_row"], cell(c["packed_ms"]), f"{c['packed_vs_one_token']:.2f}",
             cell(c["plain_ms"]), f"{c['plain_vs_one_token']:.2f}", cell(c["plain_over_packed"], 2)] for c in cells]
    print(markdown_table(["B", "T", "packed ms", "packed / T=1", "plain ms", "plain / T=1", "plain / packed"], rows))
    print(f"same argmax at every position of a 4 x 5 pass: {same}")
    write_result(args.out, args, {"cached_positions": CACHED, "threads": 1, "same_argmax": same, "cells": cells})


if __name__ == "__main__":
    main()
