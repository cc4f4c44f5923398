"""A feature drafter's decoder layer in one call of the few-row kernel's library.

Contract: `FusedFeatureLayer(...)` wraps the parts of EAGLE-3's first layer (two input norms, an
`Attention` over twice the hidden width, a post norm and an `MLP`, all of the target's layer
shape) and `__call__(embedding, state, next_tokens, positions, k_cache, v_cache, rope)` returns the layer's
output states [B, T, hidden], computed by `row_kernel.c`'s `specd_feature_layer`, after writing
the positions' keys and values into the caches ([B slots, kv heads, max_seq, head_dim], the
slots the rows use) exactly where `Attention.forward` writes them; or None where that call does
not serve, and the caller keeps its torch path: the kernel unavailable or not serving this many
rows on this thread (`packed_linear.kernel_rows`), a gradient wanted, tensors other than float32
on the CPU, a layer shape the C code does not take (biases, q/k norms), or `SPECD_FUSED_LAYER=0`
in the environment (for measuring what it buys). Its products are those of the layers' own kernel
layouts (fp16 panels for a layer marked `half_weights`), so outputs match the torch path's up to
the order of float32 sums in the norms, softmax and activation: a proposal may differ in a near
tie, a served token never (the target verifies every draft).

Why: at batch 1 a drafting step's four products take about 0.5 ms on the AMD EPYC, and torch's
dispatch of the other 40-odd small operations about as much again (`FeatureDrafterModel.step`:
1.3 ms, 2026-12-07); in C they cost a few microseconds.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from specd.model.packed_linear import PackedLinear, kernel_rows
from specd.model.row_kernel import PANEL
from specd.model.transformer import MLP, Attention

LINEARS = 4   # qkv, o, gate_up, down


class _Layer(ctypes.Structure):
    """`specd_feature_layer_t` in row_kernel.c, field for field."""

    _fields_ = [("hidden", ctypes.c_long), ("heads", ctypes.c_long), ("kv_heads", ctypes.c_long),
                ("head_dim", ctypes.c_long), ("inter", ctypes.c_long), ("max_seq", ctypes.c_long),
                ("eps", ctypes.c_float), ("embedding", ctypes.c_void_p), ("input_norm", ctypes.c_void_p),
                ("hidden_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("panels", ctypes.c_void_p * LINEARS),
                ("padded", ctypes.c_long * LINEARS), ("half", ctypes.c_long * LINEARS)]


def fused_layer_enabled() -> bool:
    return os.environ.get("SPECD_FUSED_LAYER", "1") != "0"


class FusedFeatureLayer:
    """The C path of one feature-drafter layer (see the module's contract); holds no weights of its own."""

    def __init__(self, input_norm: nn.RMSNorm, hidden_norm: nn.RMSNorm, attn: Attention, post_norm: nn.RMSNorm,
                 mlp: MLP) -> None:
        self.attn, self.mlp = attn, mlp
        self.norms = (input_norm, hidden_norm, post_norm)
        self.linears: tuple[PackedLinear, ...] = (attn.qkv, attn.o, mlp.gate_up, mlp.down)

    def __call__(self, embedding: torch.Tensor, state: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        batch, length = next_tokens.shape
        kernel = kernel_rows(batch * length)
        if kernel is None or kernel.feature_layer is None or not fused_layer_enabled() \
                or not self._serves(embedding, state, k_cache, v_cache, rope):
            return None
        layouts = [linear.kernel_panels(kernel) for linear in self.linears]
        layer = self._describe(embedding, layouts, k_cache.shape[2], rope)
        state = state.contiguous()
        tokens = next_tokens.to(torch.long).contiguous()
        where = positions.to(torch.long).expand(batch, length).contiguous()
        # the C code indexes without checks: a position past the cache or the rotary tables, or a
        # token past the embedding, takes the torch path, which raises
        if not (int(where.min()) >= 0 and int(where.max()) < min(k_cache.shape[2], rope[0].shape[0])
                and int(tokens.min()) >= 0 and int(tokens.max()) < embedding.shape[0]):
            return None
        out = torch.empty_like(state)
        failed = kernel.feature_layer(ctypes.byref(layer), batch, length, state.data_ptr(), tokens.data_ptr(),
                                      where.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr())
        return None if failed else out

    def _serves(self, embedding: torch.Tensor, state: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> bool:
        config = self.attn.config
        if config.attention_bias or self.attn.q_norm is not None or torch.is_grad_enabled():
            return False
        if len({norm.eps for norm in self.norms}) != 1 or self.norms[0].eps is None:
            return False
        if not all(linear.serves_kernel() for linear in self.linears):
            return False
        tensors = (state, k_cache, v_cache, embedding, *rope, *(norm.weight for norm in self.norms))
        return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) and all(
            t.is_contiguous() for t in (k_cache, v_cache, embedding, *rope, *(norm.weight for norm in self.norms)))

    def _describe(self, embedding: torch.Tensor, layouts: list[torch.Tensor], max_seq: int,
                  rope: tuple[torch.Tensor, torch.Tensor]) -> _Layer:
        config, (input_norm, hidden_norm, post_norm) = self.attn.config, self.norms
        layer = _Layer(hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
                       head_dim=config.head_dim, inter=config.intermediate_size, max_seq=max_seq,
                       eps=float(input_norm.eps or 0.0), embedding=embedding.data_ptr(),
                       input_norm=input_norm.weight.data_ptr(), hidden_norm=hidden_norm.weight.data_ptr(),
                       post_norm=post_norm.weight.data_ptr(), cos=rope[0].data_ptr(), sin=rope[1].data_ptr())
        for index, panels in enumerate(layouts):
            layer.panels[index] = panels.data_ptr()
            layer.padded[index] = panels.shape[0] * PANEL
            layer.half[index] = int(panels.dtype == torch.float16)
        return layer
