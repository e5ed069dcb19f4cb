"""RMS normalisation (spec §5): weighted `RMSNorm` and the unweighted RMS scaling.

Statistics are always taken in fp32; the weighted norm keeps its weight in fp32 (the official
reference does the same) and casts once at the end.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) over the last dim, in fp32 (no weight). Returns fp32."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """y = w ⊙ x · rsqrt(mean(x²) + eps); w fp32 [dim]; output in x's dtype."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * rms_scale(x, self.eps)).to(x.dtype)
