"""Torch reference of `compressor_pool` (see `compressor.py` for the op and its fused kernel).

Kept apart from the kernel module so that the models import it without importing Triton.
"""

from __future__ import annotations

import torch


def _check_args(kv, score, norm_weight, eps, out_dtype) -> None:
    if kv.dim() != 3:
        raise ValueError(f"kv must be [n, slots, d], got shape {tuple(kv.shape)}")
    if score.shape != kv.shape:
        raise ValueError(f"score must have kv's shape {tuple(kv.shape)}, got {tuple(score.shape)}")
    if tuple(norm_weight.shape) != (kv.shape[-1],):
        raise ValueError(f"norm_weight must be [d={kv.shape[-1]}], got {tuple(norm_weight.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be a floating torch.dtype, got {out_dtype!r}")


def compressor_pool_ref(kv: torch.Tensor, score: torch.Tensor, norm_weight: torch.Tensor, *, eps: float,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """Gated pooling of complete groups into compressed entries, then the compressor's RMSNorm
    (deepseek_v4 spec §8.2, deepseek_v41 spec §5.2).

    Shape: kv [n, slots, d] values; score [n, slots, d] gate logits (fp32, position bias already
    added; −inf = an empty slot, weight 0); norm_weight [d] fp32. Per entry and channel:
    α = softmax over the slots of score (fp32), pooled = Σ α·kv in fp32, rounded to `out_dtype`
    (what the models store), then w ⊙ pooled · rsqrt(mean(pooled²) + eps) in fp32, cast to
    `out_dtype`. Returns [n, d] pre-RoPE entries in `out_dtype`.
    """
    _check_args(kv, score, norm_weight, eps, out_dtype)
    weights = score.float().softmax(dim=1)  # per channel over the slots
    pooled = (kv.float() * weights).sum(dim=1).to(out_dtype).float()  # [n, d]
    normed = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps)
    return (norm_weight.float() * normed).to(out_dtype)
