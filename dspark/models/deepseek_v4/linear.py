"""The dense projections: `nn.Linear` (no bias) whose calls run the kernel registry's `linear` op.

Same parameter and checkpoint key (`<name>.weight` [out, in]) as `nn.Linear`, so loaders, sharding
and state dicts see no difference. On CUDA the op is the few-row kernels of `dspark.kernels.linear`
for decode and verify calls (≤ 16 rows) and torch's matmul for prefill; on CPU torch's matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.kernels import KernelConfig, get_op


class Linear(nn.Linear):
    """y = x·Wᵀ, x [..., in] -> [..., out] in x's dtype (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, dtype=None, device=None,
                 kernels: KernelConfig | None = None):
        super().__init__(in_features, out_features, bias=False, dtype=dtype, device=device)
        self.linear_op = get_op(KernelConfig() if kernels is None else kernels, "linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_op(x, self.weight)
