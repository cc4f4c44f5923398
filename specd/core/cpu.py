"""What this CPU does natively, for choices that are fast on one CPU and slow on another.

Contract: `native_bfloat16()` is True where the CPU has bfloat16 arithmetic (AVX-512 BF16 or AMX),
so that torch's bfloat16 matmuls run on it rather than being emulated. Where it is False, bfloat16
autocast is far slower than float32: on a 2-core AMD EPYC with AVX2 a 576x1536 layer's forward and
backward over 256 rows took 264-303 ms under bf16 autocast against 17-18 ms in float32.
"""

from __future__ import annotations

import torch


def native_bfloat16() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
