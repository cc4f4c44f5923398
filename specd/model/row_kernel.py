"""The few-row float32 kernel (`row_kernel.c`): built on first use with the machine's C compiler.

Contract: `row_kernel()` returns the process's `RowKernel`, or None where it cannot be had: no C
compiler, a failed build, a platform without `ctypes` shared libraries, or `SPECD_ROW_KERNEL=0` in
the environment. Callers then keep their torch paths; nothing else changes. The library is compiled
once per machine (`cc -O3 -march=native`, or `$CC`) into `$SPECD_CACHE/kernels` (default
`~/.cache/specd/kernels`) under a name derived from the source, the flags, the compiler and the
CPU's feature flags, so a changed source or another CPU builds afresh, and concurrent builders
never see a half-written file.
`kernel_from(source)` builds and loads another source of the same contract the same way (benchmarks
time an earlier kernel against this one). `RowKernel.panels(weight)` lays an [out, in] float32
weight out as the kernel reads it (panels of `panel_width` outputs, the CPU's vector);
`RowKernel.linear(x, panels, out_features)` multiplies x's rows (any leading shape, float32, CPU)
through it on the calling thread and returns a new tensor of shape [*x.shape[:-1], out_features].
A row's result has the same bits whatever the other rows are (`row_kernel.c` says why). Where the
CPU converts fp16 (`RowKernel.has_half`), `half_panels(weight)` gives the same layout in fp16
(float32 panels for a weight that does not fit fp16's range), and
`linear` over fp16 panels equals `linear` over float32 panels of the weight rounded to fp16, bit for
bit: half the bytes to read, for layers whose products may be rounded (a drafter's).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from specd.core.provenance import cpuinfo_line
from specd.model.bundled import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("row_kernel.c")
# -march=native: this CPU's widest vectors (hence the CPU's flags in the cache key); -ffp-contract=fast:
# the decoder layer's own sums fused alike wherever they run (the products' multiply-adds are explicit
# intrinsics, which no tuning heuristic splits, so a row's bits never depend on the block)
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c11", "-shared", "-fPIC")
PADDING = 16         # output features are padded to a multiple of this (the C call's N16)
BUILD_TIMEOUT_S = 120


class RowKernel:
    """The loaded library's `specd_rows_linear`, with the layout it reads."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._multiply = library.specd_rows_linear
        self._multiply.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                                   ctypes.c_void_p]
        self._multiply.restype = None
        # absent where the CPU has no fp16 conversion (row_kernel.c builds it under __F16C__ only)
        self._multiply_half = getattr(library, "specd_rows_linear_half", None)
        if self._multiply_half is not None:
            self._multiply_half.argtypes = self._multiply.argtypes
            self._multiply_half.restype = None
        # output features per panel (the CPU's vector); an older source's build has 16-wide panels
        width = getattr(library, "specd_panel_width", None)
        if width is not None:
            width.restype = ctypes.c_int
        self.panel_width = int(width()) if width is not None else 16
        # a whole decoder layer (`specd.model.fused_layer`); absent from an older source's build
        self.layer = getattr(library, "specd_layer", None)
        if self.layer is not None:
            self.layer.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, *[ctypes.c_void_p] * 6]
            self.layer.restype = ctypes.c_int

    @property
    def has_half(self) -> bool:
        """Whether this build multiplies through fp16 panels (`half_panels`)."""
        return self._multiply_half is not None

    def panels(self, weight: torch.Tensor) -> torch.Tensor:
        """[out, in] -> [padded / W, in, W] for W = `panel_width`, out zero-padded to a multiple of 16:
        panel p holds outputs W p .. W p + W - 1."""
        out_features, in_features = weight.shape
        padded, width = -(-out_features // PADDING) * PADDING, self.panel_width
        source = weight.detach().to(torch.float32)
        if padded != out_features:
            source = torch.cat([source, source.new_zeros(padded - out_features, in_features)])
        return source.reshape(padded // width, width, in_features).transpose(1, 2).contiguous()

    def half_panels(self, weight: torch.Tensor) -> torch.Tensor:
        """`panels(weight)` in fp16 where this build reads fp16 and every weight fits fp16's range
        (finite, at most 65504 in magnitude); float32 panels otherwise."""
        panels = self.panels(weight)
        if not self.has_half or not bool(panels.abs().max() <= torch.finfo(torch.float16).max):
            return panels  # a NaN fails the comparison too: such a weight keeps float32
        return panels.to(torch.float16)

    def linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
        in_features = panels.shape[1]
        rows = x.reshape(-1, in_features).contiguous()
        padded = panels.shape[0] * panels.shape[2]
        out = torch.empty(rows.shape[0], padded, dtype=torch.float32)
        multiply = self._multiply_half if panels.dtype == torch.float16 else self._multiply
        if multiply is None:
            raise RuntimeError("fp16 panels given to a kernel built without fp16 conversion")
        multiply(rows.data_ptr(), rows.shape[0], in_features, panels.data_ptr(), padded, out.data_ptr())
        if padded != out_features:
            out = out[:, :out_features].contiguous()
        return out.reshape(*x.shape[:-1], out_features)


@functools.cache
def row_kernel() -> RowKernel | None:
    """This process's kernel, built or found in the cache on the first call; None where it cannot be had."""
    if os.environ.get("SPECD_ROW_KERNEL", "1") == "0":
        return None
    try:
        return kernel_from(SOURCE)
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        log.warning("the few-row kernel is unavailable (%s); linear layers keep torch's paths", error)
        return None


def kernel_from(source: Path) -> RowKernel:
    """A kernel built from another source with the same contract (benchmarks time an earlier
    version against this one); raises where it cannot be built or loaded."""
    return RowKernel(ctypes.CDLL(str(_built_library(source))))


def _built_library(source: Path) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), _cpu_flags().encode()):
        key.update(part)
    target = cache_dir() / "kernels" / f"row_kernel-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(source), "-lm"], capture_output=True,
                                text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: another process sees the whole library or none
    return target


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so that a cache shared between machines never serves code
    built for instructions this CPU lacks."""
    return cpuinfo_line("flags") or os.uname().machine
