"""RMS normalisation (spec §5): weighted `RMSNorm` and the unweighted RMS scaling.

Statistics are always taken in fp32; the weighted norm keeps its weight in fp32 (the official
reference does the same) and casts once at the end. Both are the kernel registry's `rms_norm`
op: `RMSNorm` runs the implementation its `KernelConfig` picks (one fused kernel on CUDA),
`rms_scale` is the torch reference.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.kernels import KernelConfig, get_op
from dspark.kernels.rms_norm_ref import rms_norm_ref


def rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) over the last dim, in fp32 (no weight). Returns fp32."""
    return rms_norm_ref(x, None, eps=eps, out_dtype=torch.float32)


class RMSNorm(nn.Module):
    """y = w ⊙ x · rsqrt(mean(x²) + eps); w fp32 [dim]; output in x's dtype.

    `kernels` picks the registry's `rms_norm` implementation (default: the torch reference); the
    fused one runs the reference itself while autograd records (training).
    """

    def __init__(self, dim: int, eps: float, device=None, kernels: KernelConfig | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))
        # x [..., dim], weight [dim] fp32 -> [..., dim] in out_dtype
        self.norm_op = get_op(KernelConfig() if kernels is None else kernels, "rms_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_op(x, self.weight, eps=self.eps, out_dtype=x.dtype)
