"""A linear layer that multiplies through a prepared copy of its weight when no gradient is wanted.

Contract: `PackedLinear` is an `nn.Linear` (same parameters, same state dict, same autograd). When
no gradient is needed (inference mode, `no_grad`, or neither input nor weight requires one), the
weight and input are float32 on the CPU and this torch has oneDNN, the forward multiplies:
- on one intra-op thread, up to `kernel_reach` rows, through specd's few-row kernel
  (`row_kernel`, compiled on first use) over a copy in its panel layout;
- otherwise one row through a transposed copy of the weight (MKL's matrix-vector product) and more
  rows through a copy that oneDNN reordered once into its blocked layout.
A layer marked `half_weights` (`serve_weights_in_half`: a drafter's, whose products only propose
drafts that the target verifies) gives the kernel its weights in fp16 where the CPU converts fp16:
its products are then exactly those of its weights rounded to fp16 (float32 arithmetic), at half
the bytes read; the other paths are unchanged. `SPECD_HALF_WEIGHTS=0` keeps such layers in float32.
Otherwise (a gradient wanted, another dtype or device, no oneDNN) it is `F.linear`. A copy is
remade whenever the weight changes (another tensor, or an in-place write that moves its version
counter), so hot-swapped or trained weights are never served stale. `SPECD_PACKED_LINEAR=0` in the
environment turns every copy off and `SPECD_ROW_KERNEL=0` only the kernel (for measuring what they
buy). `prepare_layouts(module)` makes the copies ahead of use: engines call it on their models when
built, and a hot-swapped version gets it on the swapper's thread before it is installed, so no
decoding step makes one.

Why: `F.linear` on the CPU calls MKL's sgemm, which repacks the weight on every call and, below 4
rows, runs one matrix-vector product per row. SmolLM2-135M's 49152-row output layer took 10, 23, 34
and 17 ms for 1, 2, 3 and 4 rows that way, and 7.5, 9.0, 6.6 and 6.1 ms packed (one thread, AMD EPYC,
2026-12-04). A verification pass multiplies k + 1 rows a request, so that cliff decided whether
drafting paid. oneDNN's packed product gives a row the same bits however many rows share the call
(from 2 rows up in every layer measured; MKL's changes below 4 rows), but on an Intel Xeon it
streamed the weights slower for 2-5 rows than MKL's one-row product: a verification pass cost
1.33-1.41 one-token passes there. The few-row kernel reads each weight once for up to 12 rows (48
on an Intel CPU with AVX-512, where it beat oneDNN's product up to there) and keeps a row's bits
whatever the other rows are, one row included: a batch-1 pass of 2-5 tokens
costs 1.07-1.16 one-token passes on that Xeon, and the one-token pass is no slower than MKL's
(benchmarks/target_pass_cost.py). It runs on the calling thread only, so with more intra-op
threads torch's threaded products serve instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specd.core.cpu import intel_avx512
from specd.model.row_kernel import RowKernel, row_kernel

# one block of the kernel's rows (row_kernel.c's MAX_ROWS): its reach on AMD's CPUs and on AVX2
# builds, where it was not measured further
NARROW_BUILD_ROWS = 12
# rows up to which the few-row kernel is used on one thread (benchmarks/target_pass_cost.py
# --kernel-rows times it past them): 48 on an Intel Xeon with AVX-512, where a SmolLM2 pass
# through the kernel beat oneDNN's packed products 1.4-1.7x at 4-16 rows, 1.14x at 48 and 1.05x at
# 64 (benchmarks/results/target_pass_cost_xeon_rows.json), and lost at 96-128 (0.90-0.93x); those
# 48 were measured for the kernel built with AVX-512 (16-wide panels), so a build without it on the
# same CPU (a `$CC` that leaves AVX-512 out: 8-wide panels) keeps one block (`kernel_reach`)
KERNEL_MAX_ROWS = 48 if intel_avx512() else NARROW_BUILD_ROWS


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
    """`nn.Linear` whose no-gradient float32 CPU forward uses a cached layout of its weight: the
    few-row kernel's panels on one thread, else a transposed copy for one row and oneDNN's packed
    one for more."""

    # layout name -> (weight, its version, its data pointer, the copy in that layout)
    _layouts: dict[str, tuple[torch.Tensor, int, int, torch.Tensor]] | None = None
    half_weights = False   # the kernel may read this layer's weights in fp16 (`serve_weights_in_half`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._may_pack(x):
            return F.linear(x, self.weight, self.bias)
        kernel = kernel_rows(x.numel() // x.shape[-1])
        if kernel is not None:
            out = kernel.linear(x, self.kernel_panels(kernel), self.out_features)
            return out if self.bias is None else out + self.bias
        if x.numel() == x.shape[-1]:
            # one row (decoding one request without drafts): MKL's matrix-vector product over an
            # [in, out] copy beats both F.linear and oneDNN (a SmolLM2-135M pass: 44 against 56-58 ms)
            out = torch.matmul(x, self._layout("transposed", _transposed))
            return out if self.bias is None else out + self.bias
        packed = self._layout("packed", _onednn_packed)
        if x.numel() == 2 * x.shape[-1]:
            # oneDNN streams the weight slower for 2 rows than for 3 (a SmolLM2-135M pass: 63 against
            # 52 ms); a third row, dropped after, gives the 2 rows the same bits faster
            rows = x.reshape(2, x.shape[-1])
            out = torch.ops.mkldnn._linear_pointwise(torch.cat([rows, rows[:1]]), packed, self.bias, "none", [], "")
            return out[:2].reshape(*x.shape[:-1], out.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    def prepare(self) -> None:
        """Make the layouts this thread count uses now, so that no decoding step waits for them, and
        drop the few-row copy it does not use (each is a whole copy of the weight: a server pinned
        to one core after its engine was built at two held an unused transposed target, 513 MB)."""
        if self._weight_may_pack():
            kernel = kernel_rows(1)
            if kernel is not None:
                used = self._kernel_layout(kernel)
                self.kernel_panels(kernel)
                unused = {"transposed", "panels", "half_panels"} - {used[0]}
            else:
                self._layout("transposed", _transposed)
                unused = {"panels", "half_panels"}
            assert self._layouts is not None
            for name in unused:
                self._layouts.pop(name, None)
            self._layout("packed", _onednn_packed)

    def kernel_panels(self, kernel: RowKernel) -> torch.Tensor:
        """This layer's weights as `kernel` reads them (made, or remade after a change, on demand)."""
        name, make = self._kernel_layout(kernel)
        panels = self._layout(name, make)
        if panels.shape[-1] != kernel.panel_width:  # laid out for another kernel (a benchmark times two)
            assert self._layouts is not None
            del self._layouts[name]
            panels = self._layout(name, make)
        return panels

    def _kernel_layout(self, kernel: RowKernel) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The kernel's copy of this layer's weights: fp16 panels for a `half_weights` layer (where
        the kernel reads them), float32 panels otherwise."""
        if self.half_weights and _HALF_WEIGHTS and kernel.has_half:
            return "half_panels", kernel.half_panels
        return "panels", kernel.panels

    def _weight_may_pack(self) -> bool:
        return packing_on() and self.weight.dtype == torch.float32 and self.weight.device.type == "cpu"

    def _may_pack(self, x: torch.Tensor) -> bool:
        wants_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        return not wants_grad and x.dtype == torch.float32 and x.device.type == "cpu" and self._weight_may_pack()

    def _layout(self, name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        weight = self.weight
        version, pointer = _version_of(weight), weight.data_ptr()
        if self._layouts is None:
            self._layouts = {}
        cached = self._layouts.get(name)
        if cached is not None and cached[0] is weight and cached[1] == version and cached[2] == pointer:
            return cached[3]
        with torch.no_grad():
            copy = make(weight.detach())
        self._layouts[name] = (weight, version, pointer, copy)
        return copy

    def __getstate__(self) -> dict[str, object]:
        # oneDNN's packed tensor has no storage to copy or pickle; a copy makes its own layouts
        state = dict(super().__getstate__())
        state.pop("_layouts", None)
        return state


def prepare_layouts(module: nn.Module) -> None:
    """Every `PackedLinear` in `module` makes its layouts now (a SmolLM2-135M target: about 2.8 s;
    a feature drafter version: about 70 ms, which would otherwise fall on its first step)."""
    for layer in module.modules():
        if isinstance(layer, PackedLinear):
            layer.prepare()


def serve_weights_in_half(module: nn.Module) -> None:
    """Mark every `PackedLinear` in `module` `half_weights`: for layers whose outputs need not be
    the float32 product (a drafter's proposals: drafts are verified by the target, so rounding its
    weights can change which drafts are proposed, never what is served). Weights already held in
    fp16 (the shipped drafter's file) give the same products as in float32."""
    for layer in module.modules():
        if isinstance(layer, PackedLinear):
            layer.half_weights = True


def packing_on() -> bool:
    """Whether layers use their prepared copies now (`packing_enabled` at import, or as a benchmark set it)."""
    return _PACKING


def kernel_rows(rows: int) -> RowKernel | None:
    """The few-row kernel where it serves these rows: built, on one thread (it runs on the calling
    thread only; with more, torch's threaded products win), and no more rows than it beats oneDNN at."""
    if torch.get_num_threads() != 1:
        return None
    kernel = row_kernel()
    return kernel if kernel is not None and rows <= kernel_reach(kernel) else None


def kernel_reach(kernel: RowKernel) -> int:
    """The most rows `kernel` serves: `KERNEL_MAX_ROWS`, or `NARROW_BUILD_ROWS` for a build narrower
    than AVX-512's (the CPU's flags say what it could run, the build what it does)."""
    return KERNEL_MAX_ROWS if kernel.panel_width >= 16 else min(KERNEL_MAX_ROWS, NARROW_BUILD_ROWS)


def _transposed(weight: torch.Tensor) -> torch.Tensor:
    return weight.t().contiguous()


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


_PACKING = packing_enabled()
_HALF_WEIGHTS = os.environ.get("SPECD_HALF_WEIGHTS", "1") != "0"
