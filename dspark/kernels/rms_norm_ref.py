"""Torch reference of the `rms_norm` op (the op and its numerics: `rms_norm.py`).

Pure torch, no Triton import: the models' `deepseek_v4.norm` computes with it on every platform.
"""

from __future__ import annotations

import torch


def _check_args(x: torch.Tensor, weight: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    if x.dim() == 0 or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [..., D], got {x.dtype} of shape {tuple(x.shape)}")
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != x.shape[-1]):
        raise ValueError(f"weight must be [D={x.shape[-1]}] or None, got shape {tuple(weight.shape)}")
    if not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be a float dtype, got {out_dtype}")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, *, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """[weight ⊙] x · rsqrt(mean(x²) + eps) in fp32, cast to out_dtype (see `rms_norm.py`)."""
    _check_args(x, weight, out_dtype)
    x = x.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight * y
    return y.to(out_dtype)
