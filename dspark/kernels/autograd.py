"""When a fused op without a backward must run its torch reference instead: while autograd records.

The Triton ops compute forward values only. A DSpark drafter is trained under autograd with the
same modules that run fused at inference, so an op called while autograd would record it (grad
mode on and an input that requires grad) runs its reference, whose torch ops carry the gradient.
Frozen inference models (requires_grad False) and `torch.no_grad` / `torch.inference_mode` calls
keep the fused kernel.
"""

from __future__ import annotations

import torch


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """True when grad mode is on and any of `tensors` (None entries ignored) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
