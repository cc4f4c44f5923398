"""What a target pass costs by rows and tokens a row: the blocks in one C call, the few-row kernel,
oneDNN-packed linear layers and MKL's.

The bundled SmolLM2-135M in float32, one thread (the demo's serving thread), after a 300-token
prefill of every cache slot: a pass over B rows of T new tokens each (`--batches`, default 1, 2, 4,
8; `--tokens`, default 1..5: a verification pass at k = T − 1), in four settings (`--settings`
keeps some): `kernel` (as served: each block in one C call, `specd.model.fused_layer`, its products
through specd's few-row kernel, up to `--kernel-rows` rows a call), `torch-layers` (the same
products, the rest of each block through torch's operations: `SPECD_FUSED_LAYER=0`), `packed` (the
kernel off, hence the C blocks too: MKL's product for one row, oneDNN's packed one for more) and
`plain` (packing off: `F.linear`), and with `--kernel-source FILE`
a fifth, `source` (the kernel built from FILE, say an earlier `row_kernel.c` taken with `git show`,
so that two kernels are timed in the same rounds), in `--repeats` interleaved rounds (each round
times every cell in every setting, 3 passes a timing). Per cell: the median and spread of the
milliseconds a pass, the per-round ratios torch-layers / kernel, packed / kernel and plain / packed
(and source / kernel), and the cost of each T relative to T = 1 in the same setting (what drafting
must beat). Also checks that every setting picks the same argmax at every position of a B = 4, T = 5
pass, and that `kernel` and `source` give it the same logits to the bit. Writes JSON (default
out/target_pass_cost.json) and prints a table.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import cell, markdown_table, parser, spread, write_result

from specd.model import packed_linear
from specd.model.row_kernel import RowKernel, kernel_from, row_kernel
from specd.model.target import LoadedTarget

BATCHES = (1, 2, 4, 8)
TOKENS = (1, 2, 3, 4, 5)
CACHED = 300
# name -> (packing on, rows up to which the few-row kernel serves)
# name -> (packing on, rows up to which the few-row kernel serves, blocks in one C call where it serves)
SETTINGS = {"kernel": (True, packed_linear.KERNEL_MAX_ROWS, True),
            "torch-layers": (True, packed_linear.KERNEL_MAX_ROWS, False), "packed": (True, 0, False),
            "plain": (False, 0, False)}
# per-round ratios reported, where both settings ran
RATIOS = (("torch-layers", "kernel"), ("packed", "kernel"), ("plain", "packed"), ("source", "kernel"))
OWN_KERNEL = packed_linear.row_kernel
SOURCE_KERNEL: dict[str, RowKernel] = {}   # --kernel-source's build, served in the `source` setting


def _use(setting: tuple[bool, int, bool], name: str = "") -> None:
    packed_linear._PACKING, packed_linear.KERNEL_MAX_ROWS, layers_in_c = setting
    os.environ["SPECD_FUSED_LAYER"] = "1" if layers_in_c else "0"
    # each kernel reads the layers' copies laid out for its own panel width
    source = functools.partial(SOURCE_KERNEL.get, "source")
    packed_linear.row_kernel = source if name == "source" else OWN_KERNEL  # type: ignore[assignment]


def time_pass(model: torch.nn.Module, cache: Any, batch: int, tokens: int, passes: int = 3,
              capture: tuple[int, ...] = ()) -> float:
    """Milliseconds a pass over `batch` rows of `tokens` new tokens after `CACHED` cached ones takes
    (the mean of `passes`); with `capture`, the features of those layers are returned too, as a
    feature drafter's engine asks."""
    new = torch.randint(0, 40000, (batch, tokens))
    start = torch.full((batch,), CACHED, dtype=torch.long)
    begin = time.perf_counter()
    for _ in range(passes):
        model(new, start, cache, logits_for="all", return_hidden=bool(capture), capture_layers=capture)
    return (time.perf_counter() - begin) / passes * 1000


def _same_argmax(model: torch.nn.Module, cache: Any) -> tuple[bool, bool | None]:
    """Whether every setting picks the same argmax at every position of a 4 x 5 pass, and whether
    `kernel` and `source` give the same logits to the bit (None unless both run)."""
    probe = torch.randint(0, 40000, (4, 5), generator=torch.Generator().manual_seed(0))
    start = torch.full((4,), CACHED, dtype=torch.long)
    logits_of = {}
    for name, setting in SETTINGS.items():
        _use(setting, name)
        logits, _ = model(probe, start, cache, logits_for="all")
        logits_of[name] = logits
    picks = [logits.argmax(-1) for logits in logits_of.values()]
    same_bits = (torch.equal(logits_of["kernel"], logits_of["source"])
                 if {"kernel", "source"} <= set(logits_of) else None)
    return all(torch.equal(picks[0], other) for other in picks[1:]), same_bits


def main() -> None:
    p = parser(__doc__, "out/target_pass_cost.json", 7)
    p.add_argument("--kernel-rows", type=int, default=packed_linear.KERNEL_MAX_ROWS,
                   help="rows a call up to which the kernel setting uses the few-row kernel")
    p.add_argument("--kernel-source", type=Path, default=None,
                   help="also time the kernel built from this C source (an earlier row_kernel.c) as `source`")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="rows a pass, comma-separated")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                   help="new tokens a row, comma-separated (a verification pass at k = T - 1; 1 is always timed)")
    p.add_argument("--settings", default=None,
                   help=f"only these settings, comma-separated (of {', '.join(SETTINGS)}, and source)")
    args = p.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    tokens_list = tuple(sorted({1, *(int(t) for t in args.tokens.split(","))}))
    SETTINGS["kernel"] = (True, args.kernel_rows, True)
    SETTINGS["torch-layers"] = (True, args.kernel_rows, False)
    if args.kernel_source is not None:
        SOURCE_KERNEL["source"] = kernel_from(args.kernel_source)
        SETTINGS["source"] = (True, args.kernel_rows, True)
    if args.settings is not None:
        chosen = args.settings.split(",")
        for name in list(SETTINGS):
            if name not in chosen:
                del SETTINGS[name]
    torch.set_num_threads(1)
    model = LoadedTarget.load().model.eval()
    slots = max(*batches, 4)  # the argmax check's pass has 4 rows
    cache = model.new_cache(slots, CACHED + max(tokens_list) + 16)
    times: dict[str, dict[tuple[int, int], list[float]]] = {name: {} for name in SETTINGS}
    with torch.inference_mode():
        model(torch.randint(0, 40000, (slots, CACHED)), torch.zeros(slots, dtype=torch.long), cache,
              logits_for="none")
        same, same_bits = _same_argmax(model, cache)
        for round_number in range(args.repeats):
            names = list(SETTINGS)
            order = names[round_number % len(names):] + names[:round_number % len(names)]
            for name in order:
                _use(SETTINGS[name], name)
                time_pass(model, cache, 1, 1, passes=1)  # the first packed call packs
                time_pass(model, cache, max(batches), 1, passes=1)
                for batch in batches:
                    for tokens in tokens_list:
                        times[name].setdefault((batch, tokens), []).append(time_pass(model, cache, batch, tokens))
            print(f"  round {round_number + 1}/{args.repeats}", flush=True)
    _use((packed_linear.packing_enabled(), packed_linear.KERNEL_MAX_ROWS, True))
    cells = []
    for batch in batches:
        for tokens in tokens_list:
            entry: dict[str, Any] = {"batch": batch, "tokens_per_row": tokens}
            for name in SETTINGS:
                entry[f"{name}_ms"] = spread(times[name][(batch, tokens)])
                entry[f"{name}_vs_one_token"] = (entry[f"{name}_ms"]["median"]
                                                 / statistics.median(times[name][(batch, 1)]))
            for slower, faster in [pair for pair in RATIOS if set(pair) <= set(SETTINGS)]:
                entry[f"{slower}_over_{faster}"] = spread([a / b for a, b in zip(
                    times[slower][(batch, tokens)], times[faster][(batch, tokens)], strict=True)])
            cells.append(entry)
    rows = [[c["batch"], c["tokens_per_row"]] + [item for name in SETTINGS for item in
                                                 (cell(c[f"{name}_ms"]), f"{c[f'{name}_vs_one_token']:.2f}")]
            + [cell(c[f"{slower}_over_{faster}"], 2) for slower, faster in RATIOS if f"{slower}_over_{faster}" in c]
            for c in cells]
    print(markdown_table(["B", "T"] + [h for name in SETTINGS for h in (f"{name} ms", f"{name} / T=1")]
                         + [f"{slower} / {faster}" for slower, faster in RATIOS if {slower, faster} <= set(SETTINGS)],
                         rows))
    print(f"same argmax at every position of a 4 x 5 pass in every setting: {same}; "
          f"kernel's logits equal to source's: {same_bits}")
    write_result(args.out, args, {"cached_positions": CACHED, "threads": 1, "kernel_rows": args.kernel_rows,
                                  "kernel_built": row_kernel() is not None, "same_argmax": same,
                                  "kernel_logits_equal_source": same_bits, "cells": cells})


if __name__ == "__main__":
    main()
