"""A decoder layer at a few positions in one call of the few-row kernel's library.

Contract: `FusedLayer(input_norms, attn, post_norm, mlp)` wraps a Llama layer's parts: a target's
block (`input_norms` = (attn_norm,)) or a feature drafter's first layer (`input_norms` =
(input_norm, hidden_norm), the attention reading [input_norm(embedding of the next token),
hidden_norm(state)], twice the width). `__call__(x, positions, k_cache, v_cache, rope,
embedding=None, next_tokens=None)` (the embedding and tokens for a feature layer only) returns the
layer's output [B, T, hidden] = x + attention + MLP as the torch modules compute it, computed by
`row_kernel.c`'s `specd_layer`, after writing the positions' keys and values into the caches
([B slots, kv heads, max_seq, head_dim], the rows' slots) where `Attention.forward` writes them;
or None where that call does not serve, and the caller keeps its torch path: the kernel
unavailable or not serving this many rows on this thread (`packed_linear.kernel_rows`), a gradient
wanted, tensors other than float32 on the CPU, a layer the C code does not take (biases, q/k
norms, norms of different eps), a position outside the cache or the rotary tables, a token outside
the embedding, or `SPECD_FUSED_LAYER=0` in the environment (for measuring what it buys). Its
products are those of the layers' own kernel layouts (fp16 panels for a layer marked
`half_weights`); the norms, softmax and activation sum in another order than torch's, so outputs
match torch's path to float32 rounding. Every position is computed alone in a fixed order: a
row's result has the same bits whatever other positions and rows share the call, so a one-token
decoding step and a verification pass agree on the rows they share, as the kernel's products do.

Why: at batch 1 torch spends more time dispatching the 40-odd small operations around a layer's
four products than on the products (a SmolLM2 block's attention alone: 0.27 ms besides its two
products; a feature drafter's step 1.3 ms, its products 0.47 ms; AMD EPYC, 2026-12-07); in C they
cost a few microseconds.
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from specd.model.packed_linear import PackedLinear, kernel_rows
from specd.model.row_kernel import PANEL

if TYPE_CHECKING:  # transformer.py builds these layers: no import back at run time
    from specd.model.transformer import MLP, Attention

LINEARS = 4   # qkv, o, gate_up, down


class _Layer(ctypes.Structure):
    """`specd_layer_t` in row_kernel.c, field for field."""

    _fields_ = [("hidden", ctypes.c_long), ("heads", ctypes.c_long), ("kv_heads", ctypes.c_long),
                ("head_dim", ctypes.c_long), ("inter", ctypes.c_long), ("max_seq", ctypes.c_long),
                ("eps", ctypes.c_float), ("embedding", ctypes.c_void_p), ("input_norm", ctypes.c_void_p),
                ("hidden_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("panels", ctypes.c_void_p * LINEARS),
                ("padded", ctypes.c_long * LINEARS), ("half", ctypes.c_long * LINEARS)]


def fused_layer_enabled() -> bool:
    return os.environ.get("SPECD_FUSED_LAYER", "1") != "0"


class FusedLayer:
    """The C path of one decoder layer (see the module's contract); holds no weights of its own."""

    def __init__(self, input_norms: tuple[nn.RMSNorm, ...], attn: Attention, post_norm: nn.RMSNorm,
                 mlp: MLP) -> None:
        self.input_norms, self.attn, self.post_norm, self.mlp = input_norms, attn, post_norm, mlp
        self.linears: tuple[PackedLinear, ...] = (attn.qkv, attn.o, mlp.gate_up, mlp.down)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], embedding: torch.Tensor | None = None,
                 next_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        batch, length = positions.shape
        kernel = kernel_rows(batch * length)
        if kernel is None or kernel.layer is None or not fused_layer_enabled():
            return None
        feature = len(self.input_norms) == 2
        if feature and (embedding is None or next_tokens is None):
            raise ValueError("a feature layer reads the embedding of the next tokens")
        if not self._serves(x, k_cache, v_cache, rope, embedding if feature else None):
            return None
        x = x.contiguous()
        where = positions.to(torch.long).contiguous()
        tokens = next_tokens.to(torch.long).contiguous() if feature and next_tokens is not None else where
        # the C code indexes without checks: a position past the cache or the rotary tables, or a
        # token past the embedding, takes the torch path, which raises
        if int(where.min()) < 0 or int(where.max()) >= min(k_cache.shape[2], rope[0].shape[0]):
            return None
        if feature and embedding is not None and not 0 <= int(tokens.min()) <= int(tokens.max()) < embedding.shape[0]:
            return None
        layer = self._describe([linear.kernel_panels(kernel) for linear in self.linears], k_cache.shape[2], rope,
                               embedding if feature else None)
        out = torch.empty_like(x)
        failed = kernel.layer(ctypes.byref(layer), batch, length, x.data_ptr(), tokens.data_ptr(), where.data_ptr(),
                              k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr())
        return None if failed else out

    def _serves(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], embedding: torch.Tensor | None) -> bool:
        norms = (*self.input_norms, self.post_norm)
        if self.attn.config.attention_bias or self.attn.q_norm is not None or torch.is_grad_enabled():
            return False
        if len({norm.eps for norm in norms}) != 1 or norms[0].eps is None:
            return False
        if not all(linear.serves_kernel() for linear in self.linears):
            return False
        held = (k_cache, v_cache, *rope, *(norm.weight for norm in norms), *(() if embedding is None else (embedding,)))
        return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (x, *held)) and all(
            t.is_contiguous() for t in held)

    def _describe(self, layouts: list[torch.Tensor], max_seq: int, rope: tuple[torch.Tensor, torch.Tensor],
                  embedding: torch.Tensor | None) -> _Layer:
        config, first = self.attn.config, self.input_norms[0]
        layer = _Layer(hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
                       head_dim=config.head_dim, inter=config.intermediate_size, max_seq=max_seq,
                       eps=float(first.eps or 0.0), embedding=None if embedding is None else embedding.data_ptr(),
                       input_norm=first.weight.data_ptr(), hidden_norm=self.input_norms[-1].weight.data_ptr(),
                       post_norm=self.post_norm.weight.data_ptr(), cos=rope[0].data_ptr(), sin=rope[1].data_ptr())
        for index, panels in enumerate(layouts):
            layer.panels[index] = panels.data_ptr()
            layer.padded[index] = panels.shape[0] * PANEL
            layer.half[index] = int(panels.dtype == torch.float16)
        return layer
