"""Fused GPU kernels, each beside a torch reference with the same signature.

Ops are reached through the registry, never imported by platform branches in the model::

    from dspark.kernels import KernelConfig, get_op
    kernels = KernelConfig.for_device(device)          # built once, passed down
    mhc_pre = get_op(kernels, "mhc_pre")               # Triton on CUDA, torch on CPU

Importing this package imports neither Triton nor the kernel modules (they load on first use), so
it works on machines without the optional ``gpu`` extra. See README.md here for the op table.
"""

from dspark.kernels.registry import (OPS, KernelConfig, get_op, head_norm_op, norm_folded_op, require_triton,
                                     triton_available)

__all__ = ["OPS", "KernelConfig", "get_op", "head_norm_op", "norm_folded_op", "require_triton", "triton_available"]
