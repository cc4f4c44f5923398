"""The output head and its cross-entropy against the target's distribution, fused and chunked.

Contract: `head_cross_entropy(x, weight, target_p, row_weight)` is Σ_r row_weight[r] ·
(−Σ_v target_p[r, v] · log softmax(x @ weight.T)[r, v]) with autograd gradients for `x` and
`weight`, and, detached, each row's cross-entropy and the argmax of its logits. `target_labels`
is the target's distribution over the draft vocabulary (float32), its entropy and its argmax.

Why: over the draft vocabulary (8192 ids) a training step's logits, label, softmax and their
gradients are tensors of about a thousand rows by 8192 that autograd keeps alive and passes over
about ten times: about a quarter of a pretraining step on this CPU went to those element-wise
passes. Here the gradient with respect to the logits is made in the forward pass (the row
weights are known then), as fused linear cross-entropy kernels do, in one pass per chunk of rows,
and two matmuls turn it into the gradients of `x` and `weight`; backward only scales them. A
pretraining step took 0.83x the time of autograd's version (2 threads; chunks of 128 to 4096
rows alike). The matmuls run in the autocast dtype when autocast is on (bfloat16 here, as
`nn.Linear` would), softmax and the label in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ROWS = 256  # rows of logits in float32 at a time (at 8192 ids, 8 MB); 128 to 4096 timed alike here


def _matmul_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target_p: torch.Tensor,
                row_weight: torch.Tensor, chunk_rows: int,
                matmul_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dtype = matmul_dtype or torch.float32
        w = weight.detach().to(dtype)
        xs = x.detach().to(dtype)
        # d/dlogits of Σ w_r · CE_r, row by row w_r (softmax − p): filled chunk by chunk, then two matmuls
        grad_logits = torch.empty(len(x), len(weight), dtype=dtype, device=x.device)
        per_row = torch.empty(len(x), dtype=torch.float32, device=x.device)
        top = torch.empty(len(x), dtype=torch.long, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            for first in range(0, len(x), chunk_rows):
                rows = slice(first, first + chunk_rows)
                logits = (xs[rows] @ w.T).float()
                top[rows] = logits.argmax(-1)
                logq = F.log_softmax(logits, dim=-1)
                p = target_p[rows]
                per_row[rows] = -(p * logq).sum(-1)
                grad_logits[rows] = logq.exp_().sub_(p).mul_(row_weight[rows].unsqueeze(-1))
            grad_x = grad_logits @ w
            grad_w = grad_logits.T @ xs
        ctx.save_for_backward(grad_x, grad_w)
        ctx.input_dtypes = (x.dtype, weight.dtype)
        ctx.mark_non_differentiable(per_row, top)
        return (per_row * row_weight).sum(), per_row, top

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_x, grad_w = ctx.saved_tensors
        x_dtype, w_dtype = ctx.input_dtypes
        return (grad_x * grad_total).to(x_dtype), (grad_w * grad_total).to(w_dtype), None, None, None, None


def head_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target_p: torch.Tensor, row_weight: torch.Tensor,
                       chunk_rows: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Σ row_weight · CE, each row's CE (detached), each row's argmax) of the logits `x @ weight.T`
    [n, V] against the rows of `target_p` [n, V] (float32, each summing to 1)."""
    total, per_row, top = _HeadCrossEntropy.apply(x, weight, target_p.float(), row_weight.float(), chunk_rows,
                                                  _matmul_dtype(x.device.type))
    return total, per_row, top


@torch.no_grad()
def target_labels(last_features: torch.Tensor, rows: torch.Tensor, eps: float,
                  chunk_rows: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's distribution over the draft vocabulary [n, V], its entropy [n] and argmax [n],
    from its last layer's states [n, hidden] and `label_rows` [V, hidden], all in float32: they
    are the label."""
    n = len(last_features)
    target_p = torch.empty(n, len(rows), dtype=torch.float32, device=last_features.device)
    entropy = torch.empty(n, dtype=torch.float32, device=last_features.device)
    top = torch.empty(n, dtype=torch.long, device=last_features.device)
    rows_t = rows.float().T
    with torch.autocast(last_features.device.type, enabled=False):
        for first in range(0, n, chunk_rows):
            chunk = slice(first, first + chunk_rows)
            last = last_features[chunk].float()
            logp = F.log_softmax(F.rms_norm(last, (last.shape[-1],), eps=eps) @ rows_t, dim=-1)
            top[chunk] = logp.argmax(-1)
            p = target_p[chunk]
            torch.exp(logp, out=p)
            entropy[chunk] = -(p * logp).sum(-1)
    return target_p, entropy, top
