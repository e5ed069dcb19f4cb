"""Torch reference of the `rope` op (the op and its numerics: `rope.py`).

Pure torch, no Triton import: the models' `deepseek_v4.rope.apply_rope` computes with it on every
platform.
"""

from __future__ import annotations

import torch


def _check_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() == 0 or cos.dim() == 0 or sin.dim() == 0:
        raise ValueError(f"x, cos and sin need a last dim, got shapes {tuple(x.shape)}, {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    half = cos.shape[-1]
    if sin.shape[-1] != half or not 0 < 2 * half <= x.shape[-1]:
        raise ValueError(f"cos/sin last dims {cos.shape[-1]}/{sin.shape[-1]} must be equal, > 0, and 2· them fit "
                         f"x's last dim {x.shape[-1]}")


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2·cos.shape[-1] dims of x pairwise (see `rope.py`)."""
    _check_args(x, cos, sin)
    rd = 2 * cos.shape[-1]
    nope, rot = x[..., :-rd], x[..., -rd:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]  # [..., rd/2] each: the real / imaginary parts
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)
