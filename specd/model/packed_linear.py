"""A linear layer that multiplies through oneDNN's prepacked weight when no gradient is wanted.

Contract: `PackedLinear` is an `nn.Linear` (same parameters, same state dict, same autograd). When
no gradient is needed (inference mode, `no_grad`, or neither input nor weight requires one), the
weight and input are float32 on the CPU and this torch has oneDNN, the forward multiplies through a
copy of the weight that oneDNN reordered once into its blocked layout; otherwise it is `F.linear`.
The copy is remade whenever the weight changes (another tensor, or an in-place write that moves its
version counter), so hot-swapped or trained weights are never served stale. `SPECD_PACKED_LINEAR=0`
in the environment turns packing off (for measuring what it buys).

Why: `F.linear` on the CPU calls MKL's sgemm, which repacks the weight on every call and, below 4
rows, runs one matrix-vector product per row. SmolLM2-135M's 49152-row output layer took 10, 23, 34
and 17 ms for 1, 2, 3 and 4 rows that way, and 7.5, 9.0, 6.6 and 6.1 ms packed (one thread, AMD EPYC,
2026-12-04). A verification pass multiplies k + 1 rows a request, so that cliff decided whether
drafting paid. oneDNN's packed product also gives a row the same bits however many rows share the
call (from 2 rows up in every layer measured; MKL's changes below 4 rows), so verification agrees with
one-token decoding at least as well as before.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def packing_enabled() -> bool:
    """Whether this process may use packed weights (oneDNN present, not switched off)."""
    if os.environ.get("SPECD_PACKED_LINEAR", "1") == "0":
        return False
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _version_of(weight: torch.Tensor) -> int:
    try:
        return int(weight._version)
    except RuntimeError:  # an inference-mode tensor keeps no version counter and cannot be written
        return -1


class PackedLinear(nn.Linear):
    """`nn.Linear` whose no-gradient float32 CPU forward uses a cached oneDNN-packed weight."""

    _packed: tuple[torch.Tensor, int, int, torch.Tensor] | None = None  # (weight, version, ptr, packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed_weight(x)
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.numel() == 2 * x.shape[-1]:
            # oneDNN streams the weight slower for 2 rows than for 3 (a SmolLM2-135M pass: 63 against
            # 52 ms); a third row, dropped after, gives the 2 rows the same bits faster
            rows = x.reshape(2, x.shape[-1])
            out = torch.ops.mkldnn._linear_pointwise(torch.cat([rows, rows[:1]]), packed, self.bias, "none", [], "")
            return out[:2].reshape(*x.shape[:-1], out.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    def _packed_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        weight = self.weight
        wants_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if (wants_grad or x.dtype != torch.float32 or weight.dtype != torch.float32
                or x.device.type != "cpu" or weight.device.type != "cpu" or not _PACKING):
            return None
        version, pointer = _version_of(weight), weight.data_ptr()
        cached = self._packed
        if cached is not None and cached[0] is weight and cached[1] == version and cached[2] == pointer:
            return cached[3]
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self._packed = (weight, version, pointer, packed)
        return packed

    def __getstate__(self) -> dict[str, object]:
        # oneDNN's packed tensor has no storage to copy or pickle; a copy packs its own weight
        state = dict(super().__getstate__())
        state.pop("_packed", None)
        return state


_PACKING = packing_enabled()
