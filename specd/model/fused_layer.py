"""A decoder layer at a few positions in one call of the few-row kernel's library.

Contract: `FusedLayer(input_norms, attn, post_norm, mlp)` wraps a Llama layer's parts: a target's
block (`input_norms` = (attn_norm,)) or a feature drafter's first layer (`input_norms` =
(input_norm, hidden_norm), the attention reading [input_norm(embedding of the next token),
hidden_norm(state)], twice the width). `__call__(x, where, k_cache, v_cache, rope, embedding=None,
next_tokens=None)` (`where`: the positions [B, T] as `c_positions` returns them, checked once a pass
against the cache and the rotary tables; the embedding and tokens for a feature layer only) returns
the layer's output [B, T, hidden] = x + attention + MLP as the torch modules compute it, computed by
`row_kernel.c`'s `specd_layer`, after writing the positions' keys and values into the caches ([B
slots, kv heads, max_seq, head_dim], the rows' slots) where `Attention.forward` writes them; or None
where that call does not serve, and the caller keeps its torch path: the kernel unavailable or not
serving this many rows on this thread (`packed_linear.kernel_rows`), a gradient wanted, tensors
other than float32 on the CPU, a layer the C code does not take (biases, q/k norms, norms of
different eps), a token outside the embedding, or `SPECD_FUSED_LAYER=0` in the environment (for
measuring what it buys). Its products are those of the layers' own kernel layouts (fp16 panels for a
layer marked `half_weights`); the norms, softmax and activation sum in another order than torch's,
so outputs match torch's path to float32 rounding. Every position is computed alone in a fixed
order: a row's result has the same bits whatever other positions and rows share the call, so a
one-token decoding step and a verification pass agree on the rows they share, as the kernel's
products do.

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

from specd.model.packed_linear import PackedLinear, kernel_rows, packing_on

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


def c_positions(positions: torch.Tensor, max_seq: int, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
    """Positions [B, T] as `FusedLayer` reads them (contiguous int64), or None where one lies outside
    the cache or the rotary tables: the C code indexes without checks, so such a pass takes the
    torch path, which raises. Checked once a pass, not once a layer."""
    where = positions.to(torch.long).contiguous()
    return where if int(where.min()) >= 0 and int(where.max()) < min(max_seq, rope[0].shape[0]) else None


class FusedLayer:
    """The C path of one decoder layer (see the module's contract); holds no weights of its own."""

    def __init__(self, input_norms: tuple[nn.RMSNorm, ...], attn: Attention, post_norm: nn.RMSNorm,
                 mlp: MLP) -> None:
        self.input_norms, self.attn, self.post_norm, self.mlp = input_norms, attn, post_norm, mlp
        self.linears: tuple[PackedLinear, ...] = (attn.qkv, attn.o, mlp.gate_up, mlp.down)
        norms = (*input_norms, post_norm)
        # the layer shapes the C code takes, fixed when the modules are built
        self.shape_served = (not attn.config.attention_bias and attn.q_norm is None
                             and all(linear.bias is None for linear in self.linears)
                             and len({norm.eps for norm in norms}) == 1 and norms[0].eps is not None)
        self._described: tuple[tuple[int, ...], _Layer] | None = None   # the last call's pointers and struct

    def __getstate__(self) -> dict[str, object]:
        # a model sent to another process (the demo's learner) leaves the struct behind: it holds
        # this process's pointers, and ctypes refuses to pickle them
        return {**self.__dict__, "_described": None}

    def __call__(self, x: torch.Tensor, where: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], embedding: torch.Tensor | None = None,
                 next_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """`where`: the positions as `c_positions` returned them for this cache and these tables."""
        batch, length = where.shape
        kernel = kernel_rows(batch * length)
        if kernel is None or kernel.layer is None or not self.shape_served or not fused_layer_enabled():
            return None
        feature = len(self.input_norms) == 2
        if feature and (embedding is None or next_tokens is None):
            raise ValueError("a feature layer reads the embedding of the next tokens")
        if not feature:
            embedding = None
        if not self._serves(x, k_cache, v_cache, rope, embedding):
            return None
        x = x.contiguous()
        tokens = where
        if feature and embedding is not None and next_tokens is not None:
            tokens = next_tokens.to(torch.long).contiguous()
            if not 0 <= int(tokens.min()) <= int(tokens.max()) < embedding.shape[0]:
                return None  # as a position out of range: the torch path raises
        layer = self._describe([linear.kernel_panels(kernel) for linear in self.linears], k_cache.shape[2], rope,
                               embedding)
        if layer is None:
            return None
        out = torch.empty_like(x)
        failed = kernel.layer(ctypes.byref(layer), batch, length, x.data_ptr(), tokens.data_ptr(), where.data_ptr(),
                              k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr())
        return None if failed else out

    def _serves(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], embedding: torch.Tensor | None) -> bool:
        """What may change between calls: a gradient wanted, packing switched off, the tensors' kind."""
        if torch.is_grad_enabled() or not packing_on():
            return False
        held = (k_cache, v_cache, *rope, *(() if embedding is None else (embedding,)))
        return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (x, *held)) and all(
            t.is_contiguous() for t in held)

    def _describe(self, layouts: list[torch.Tensor], max_seq: int, rope: tuple[torch.Tensor, torch.Tensor],
                  embedding: torch.Tensor | None) -> _Layer | None:
        """The struct the C code reads, remade only when a pointer in it changed (a new version's
        layouts, another cache or tables); None where the layer's weights are not float32 in one piece."""
        first, second = self.input_norms[0], self.input_norms[-1]
        norms = (first.weight, second.weight, self.post_norm.weight)
        key = (max_seq, *(t.data_ptr() for t in (*layouts, *rope, *norms)),
               0 if embedding is None else embedding.data_ptr())
        if self._described is not None and self._described[0] == key:
            return self._described[1]
        weights = (*norms, *(linear.weight for linear in self.linears))
        if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in weights):
            return None
        config = self.attn.config
        layer = _Layer(hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
                       head_dim=config.head_dim, inter=config.intermediate_size, max_seq=max_seq,
                       eps=float(first.eps or 0.0), embedding=None if embedding is None else embedding.data_ptr(),
                       input_norm=first.weight.data_ptr(), hidden_norm=second.weight.data_ptr(),
                       post_norm=self.post_norm.weight.data_ptr(), cos=rope[0].data_ptr(), sin=rope[1].data_ptr())
        for index, panels in enumerate(layouts):
            layer.panels[index] = panels.data_ptr()
            layer.padded[index] = panels.shape[0] * panels.shape[2]  # [panels, in, width]
            layer.half[index] = int(panels.dtype == torch.float16)
        self._described = (key, layer)
        return layer
