"""What this CPU does natively, for choices that are fast on one CPU and slow on another.

Contract: `native_bfloat16()` is True where the CPU has bfloat16 arithmetic (AVX-512 BF16 or AMX),
so that torch's bfloat16 matmuls run on it rather than being emulated. Where it is False, bfloat16
autocast is far slower than float32: on a 2-core AMD EPYC with AVX2 a 576x1536 layer's forward and
backward over 256 rows took 264-303 ms under bf16 autocast against 17-18 ms in float32.
`intel_avx512()` is True on an Intel CPU with AVX-512, where specd's few-row kernel keeps beating
oneDNN's packed products to more rows than elsewhere (`specd.model.packed_linear`).
"""

from __future__ import annotations

import torch

from specd.core.provenance import cpuinfo_line


def native_bfloat16() -> bool:
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def intel_avx512() -> bool:
    return "GenuineIntel" in (cpuinfo_line("vendor_id") or "") and bool(torch.cpu._is_avx512_supported())
