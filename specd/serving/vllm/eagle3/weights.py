"""Writing a drafter version's tensors into vLLM's running EAGLE-3 drafter, in place where the graphs need it.

Contract: `install(vllm_model, tensors, repack=None, in_place=None)` copies `tensors` (vLLM
parameter names, see `specd.drafter.vllm_format`) into the drafter's parameters. vLLM's CPU linear
layers (`cpu_linear`) compute from a packed copy of their weight and keep an empty parameter, so
such a layer is served in one of three ways, chosen at its first install and kept after:
- eager mode (`repack`, vLLM's own `dispatch_cpu_unquantized_gemm`): every new weight is packed
  again the way vLLM packs it at load; with a GEMM dtype (`vllm_cpu_repack(torch.bfloat16)`, see
  `drafter_gemm_dtype`) a copy in that dtype is packed instead and the layer casts around it, while
  its parameter keeps the version's own values; with float16 (`with_half_kernel`) specd's few-row
  kernel multiplies up to `kernel_reach` rows (12; 48 on an Intel CPU with AVX-512, built for it)
  through an fp16 copy and vLLM's float32 packing serves the rest;
- compiled mode with an `InPlaceKernel` (bfloat16 on a CPU whose vLLM has the packed-weight GEMM):
  the weight parameter holds the packed weight, a plain tensor of the weight's own shape, and
  each later version is packed and copied into it, so the graphs (traced over that parameter)
  see the new values and run at the packed kernel's speed;
- otherwise (compiled float32, or no such kernel): a plain matmul over a real parameter, which
  every later version updates in place (about 3x slower than the packed kernel for a drafter's
  small batches on this CPU, 2026-12; correct everywhere).
Every other tensor is copied into its parameter in place; a tensor of the wrong shape raises
`CheckpointError` naming it.

`prepare(vllm_model, tensors, in_place, repack)` does on the caller's thread (the swapper's) all
that can be done before the decoding thread installs: shapes checked, dtypes cast, packed layers'
weights packed, and in eager mode each new weight packed by vLLM's own `repack` on a stand-alone
layer; `install` then only copies a `Prepared` version's tensors and hands each eager layer its
packed replacement (packing on the decoding thread paused it 20-60 ms a swap in eager mode, and
about 3x the copies' time in compiled mode, 2 threads, 2026-12).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from specd.core.cpu import native_bfloat16
from specd.core.errors import CheckpointError
from specd.model import packed_linear
from specd.model.row_kernel import RowKernel, row_kernel

CpuLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # vLLM's `cpu_linear`
PACKED, PLAIN = "packed", "plain"   # a CPU linear layer's layout after specd's first install


@dataclass(frozen=True)
class InPlaceKernel:
    """A CPU GEMM over a packed weight that keeps the weight's shape and dtype (so a new version
    can be packed and copied into the tensor a compiled graph holds)."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)

    def serves(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return weight.dtype in self.dtypes and bias is None


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class Prepared:
    """A version's tensors after `prepare`: each already of its parameter's shape, dtype and layout;
    `layers`: eager mode's packed stand-alone layers (their `weight` and `cpu_linear`), by weight name."""

    tensors: dict[str, torch.Tensor]
    layers: dict[str, nn.Module] = field(default_factory=dict)


def prepare(vllm_model: nn.Module, tensors: dict[str, torch.Tensor], in_place: InPlaceKernel | None = None,
            repack: Callable[[nn.Module], None] | None = None) -> Prepared:
    """Check, cast and pack `tensors` off the decoding thread (see the module's contract); a tensor
    for a CPU layer not installed yet passes unchanged."""
    ready, layers = {}, {}
    for name, value in tensors.items():
        module, attribute = _owner(vllm_model, name)
        cpu_layer = attribute == "weight" and hasattr(module, "cpu_linear")
        if cpu_layer and repack is not None and getattr(module, "bias", None) is None:
            layers[name] = _repacked(value.to(getattr(module, attribute).dtype), repack)
        elif cpu_layer and (repack is not None or getattr(module, "specd_layout", None) is None):
            ready[name] = value  # packed again at install
        else:
            ready[name] = _ready(name, module, attribute, value, in_place)
    return Prepared(ready, layers)


def _repacked(weight: torch.Tensor, repack: Callable[[nn.Module], None]) -> nn.Module:
    """A stand-alone layer holding `weight`, packed by `repack` as vLLM packs its own layers."""
    layer = nn.Module()
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    repack(layer)
    return layer


def install(vllm_model: nn.Module, tensors: dict[str, torch.Tensor] | Prepared,
            repack: Callable[[nn.Module], None] | None = None, in_place: InPlaceKernel | None = None) -> None:
    """Copy `tensors` into the running drafter (see the module's contract for CPU linear layers)."""
    prepared = isinstance(tensors, Prepared)
    if isinstance(tensors, Prepared):
        for name, layer in tensors.layers.items():
            module, _ = _owner(vllm_model, name)
            module.weight, module.cpu_linear = layer.weight, layer.cpu_linear
        tensors = tensors.tensors
    for name, value in tensors.items():
        module, attribute = _owner(vllm_model, name)
        current = getattr(module, attribute)
        cpu_layer = attribute == "weight" and hasattr(module, "cpu_linear")
        if cpu_layer and repack is not None:
            module.weight = nn.Parameter(value.to(current.dtype).clone(), requires_grad=False)
            repack(module)
            continue
        if cpu_layer and getattr(module, "specd_layout", None) is None:
            _first_install(module, value.to(current.dtype), in_place)
            continue
        current.data.copy_(value if prepared else _ready(name, module, attribute, value, in_place))


def _owner(vllm_model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attribute = name.rpartition(".")
    return vllm_model.get_submodule(module_name), attribute


def _ready(name: str, module: nn.Module, attribute: str, value: torch.Tensor,
           in_place: InPlaceKernel | None) -> torch.Tensor:
    """`value` as its installed parameter holds it: same shape (else CheckpointError), its dtype,
    packed where the layer serves packed."""
    current = getattr(module, attribute)
    if tuple(current.shape) != tuple(value.shape):
        raise CheckpointError(f"{name}: vLLM's drafter has shape {tuple(current.shape)}, "
                              f"the version {tuple(value.shape)}")
    value = value.to(current.dtype)
    if attribute == "weight" and getattr(module, "specd_layout", None) == PACKED:
        assert in_place is not None, "a packed layer's later versions need the kernel that packed it"
        value = in_place.pack(value)
    return value


def _first_install(module: nn.Module, weight: torch.Tensor, in_place: InPlaceKernel | None) -> None:
    """Serve a CPU linear layer from a real parameter from now on: packed in place, or plain."""
    if in_place is not None and in_place.serves(weight, getattr(module, "bias", None)):
        packed = in_place.pack(weight)
        if packed.shape == weight.shape and packed.dtype == weight.dtype:
            out_features, linear = weight.shape[0], in_place.linear
            module.weight = nn.Parameter(packed, requires_grad=False)
            setattr(module, "cpu_linear", lambda x, w, b: linear(x, w, out_features, b))  # noqa: B010
            setattr(module, "specd_layout", PACKED)  # noqa: B010
            return
    module.weight = nn.Parameter(weight.clone(), requires_grad=False)
    setattr(module, "cpu_linear", _plain_linear)  # noqa: B010 (vLLM's attribute, not nn.Module's)
    setattr(module, "specd_layout", PLAIN)  # noqa: B010


def vllm_cpu_repack(gemm_dtype: torch.dtype | None = None) -> Callable[[nn.Module], None]:
    """vLLM's own packing of a CPU linear layer's weight (imported inside vLLM's worker only). With
    `gemm_dtype` other than the weight's, the layer computes through a packed copy in that dtype (its
    input cast to it and its output cast back), as `with_gemm_dtype` says; float16 means specd's
    few-row kernel over an fp16 copy for small batches (`with_half_kernel`)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    def repack(module: nn.Module) -> None:
        dispatch_cpu_unquantized_gemm(module, remove_weight=False)

    if gemm_dtype is None:
        return repack
    kernel = _half_kernel() if gemm_dtype == torch.float16 else None
    return with_half_kernel(repack, kernel) if kernel is not None else with_gemm_dtype(repack, gemm_dtype)


def with_gemm_dtype(repack: Callable[[nn.Module], None], gemm_dtype: torch.dtype) -> Callable[[nn.Module], None]:
    """`repack`, packing a `gemm_dtype` copy of each weight: the layer's `cpu_linear` casts its input
    to `gemm_dtype` and its output back to the input's dtype. A drafter's weights are read once per
    drafted token, from memory (the target's pass in between evicts them), so half the bytes make a
    float32 server's drafting passes cheaper; drafts may differ from float32's near ties, and the
    target's verification keeps the output exact whatever the drafts are."""

    def repack_in(module: nn.Module) -> None:
        weight = cast(torch.Tensor, module.weight)
        if weight.dtype == gemm_dtype or getattr(module, "bias", None) is not None:
            repack(module)
            return
        shadow = nn.Module()
        packed = nn.Parameter(weight.detach().to(gemm_dtype), requires_grad=False)
        shadow.weight = packed
        repack(shadow)
        linear = cast(CpuLinear, shadow.cpu_linear)  # vLLM's attribute, set by `repack`

        def cast_linear(x: torch.Tensor, _weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return linear(x.to(gemm_dtype), packed, bias).to(x.dtype)

        setattr(module, "cpu_linear", cast_linear)  # noqa: B010 (vLLM's attribute, not nn.Module's)

    return repack_in


def drafter_gemm_dtype(choice: str, served: torch.dtype) -> torch.dtype | None:
    """The dtype eager-mode drafter layers' weights are read in for `SPECD_DRAFTER_GEMM=choice` in a
    server of dtype `served` (None: the served dtype). `auto`: bfloat16 in a float32 server on a CPU
    with native bfloat16 arithmetic (AVX-512 BF16 or AMX), else float16 (specd's few-row kernel over
    fp16 weights, float32 arithmetic) where that kernel reads fp16: either halves the bytes a
    drafting pass reads. `float16` where the kernel cannot read fp16 keeps the served dtype."""
    if choice == "native":
        return None
    if choice == "bfloat16":
        return torch.bfloat16 if served != torch.bfloat16 else None
    half = torch.float16 if served == torch.float32 and _half_kernel() is not None else None
    if choice == "float16":
        return half
    return torch.bfloat16 if served == torch.float32 and native_bfloat16() else half


def _half_kernel() -> RowKernel | None:
    kernel = row_kernel()
    return kernel if kernel is not None and kernel.has_half else None


def with_half_kernel(repack: Callable[[nn.Module], None], kernel: RowKernel) -> Callable[[nn.Module], None]:
    """`repack`, and then an fp16 copy of each float32 weight in the few-row kernel's layout: a
    layer's `cpu_linear` multiplies up to `kernel_reach(kernel)` rows through it (on the calling thread;
    exactly the products of the weights rounded to fp16, in float32 arithmetic) and more rows through
    vLLM's own float32 packing. Drafting passes at small batches read half the bytes; the target
    verifies every draft, so outputs are unchanged."""

    def repack_in(module: nn.Module) -> None:
        repack(module)
        weight = cast(torch.Tensor, module.weight)
        if weight.dtype != torch.float32 or weight.dim() != 2:
            return
        wide = cast(CpuLinear, module.cpu_linear)  # vLLM's attribute, set by `repack`
        panels, out_features = kernel.half_panels(weight.detach()), weight.shape[0]
        reach = packed_linear.kernel_reach(kernel)  # once per install, not on every drafting call

        def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if x.dtype != torch.float32 or x.numel() > reach * x.shape[-1]:
                return wide(x, weight, bias)
            out = kernel.linear(x, panels, out_features)
            return out if bias is None else out + bias

        setattr(module, "cpu_linear", half_linear)  # noqa: B010 (vLLM's attribute, not nn.Module's)

    return repack_in


def vllm_cpu_in_place_kernel() -> InPlaceKernel | None:
    """vLLM's packed-weight GEMM (`convert_weight_packed`, `weight_packed_linear`), if this vLLM and
    CPU have it and it agrees with a plain matmul on a small check; None otherwise."""
    try:
        from vllm import _custom_ops as ops

        kernel = InPlaceKernel(pack=torch.ops._C.convert_weight_packed, linear=ops.weight_packed_linear_cpu)
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(64, 96, generator=generator).to(torch.bfloat16)
        x = torch.randn(3, 96, generator=generator).to(torch.bfloat16)
        got = kernel.linear(x, kernel.pack(weight), 64, None).float()
    except (ImportError, AttributeError, RuntimeError):
        return None
    expected = F.linear(x.float(), weight.float())
    return kernel if torch.allclose(got, expected, rtol=0.02, atol=0.05 * float(expected.abs().max())) else None
