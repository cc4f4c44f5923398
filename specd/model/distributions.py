"""From logits to distributions and draws: temperature, top-p and inverse-CDF sampling.

Contract: pure tensor functions, shared by the engine's verification and by drafters that sample;
randomness comes in as uniforms drawn by the caller from per-request generators.
"""

from __future__ import annotations

import torch


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Softmax of logits / temperature restricted to the top-p nucleus, renormalised.

    logits: [B, T, V]; temperature, top_p: [B] (rows with temperature 0 get a harmless 1).
    """
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits.float() / temp[:, None, None], dim=-1)  # [B, T, V]
    if bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is under top_p: the most likely token always stays
        keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None, None]
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: probs [..., V] (need not sum to 1), uniforms [...] in [0, 1) -> ids [...]."""
    cdf = probs.cumsum(-1)
    target = uniforms.to(cdf.dtype) * cdf[..., -1]
    index = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)
