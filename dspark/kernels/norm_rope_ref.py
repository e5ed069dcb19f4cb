"""Torch reference of the `norm_rope` op (the op and its numerics: `norm_rope.py`).

Pure torch, no Triton import. `norm_then_rope` runs the op's contract over any `rms_norm` and
`rope` implementations: the reference is it over the two references, and a model whose config keeps
`norm_rope` on its reference while `rms_norm` / `rope` are fused runs it over the fused pair.
"""

from __future__ import annotations

from typing import Callable

import torch

from dspark.kernels.rms_norm_ref import _check_args as _check_norm_args
from dspark.kernels.rms_norm_ref import rms_norm_ref
from dspark.kernels.rope_ref import _check_args as _check_rope_args
from dspark.kernels.rope_ref import rope_ref


def _check_args(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                out: torch.Tensor | None, out_rows: torch.Tensor | None) -> None:
    _check_norm_args(x, weight, x.dtype)  # x first: a non-float x is named as such
    _check_rope_args(x, cos, sin)
    if (out is None) != (out_rows is None):
        raise ValueError("out and out_rows go together: pass both or neither")
    if out is None:
        return
    dim, n_rows = x.shape[-1], x.numel() // max(x.shape[-1], 1)
    if out.dim() != 2 or out.shape[1] != dim or out.dtype != x.dtype or (dim > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [R, d={dim}] {x.dtype} with contiguous rows, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    if out_rows.shape != (n_rows,) or out_rows.dtype != torch.long:
        raise ValueError(f"out_rows must be long [M={n_rows}] (one per row of x), got {tuple(out_rows.shape)} "
                         f"{out_rows.dtype}")


def norm_then_rope(norm_op: Callable[..., torch.Tensor], rope_op: Callable[..., torch.Tensor], x: torch.Tensor,
                   weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *, eps: float,
                   out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """`norm_rope` as two ops (`norm_op` with out_dtype = x.dtype, then `rope_op`) and, with `out`,
    an `index_copy_` of y's rows [M, d] to rows `out_rows` of out. Returns y [..., d]."""
    _check_args(x, weight, cos, sin, out, out_rows)
    y = rope_op(norm_op(x, weight, eps=eps, out_dtype=x.dtype), cos, sin)
    if out is not None:
        out.index_copy_(0, out_rows, y.reshape(-1, x.shape[-1]))
    return y


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
                  eps: float, out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """`rope_ref(rms_norm_ref(x, weight, eps, out_dtype=x.dtype), cos, sin)`, rows stored at
    out[out_rows] when given (see `norm_rope.py`)."""
    return norm_then_rope(rms_norm_ref, rope_ref, x, weight, cos, sin, eps=eps, out=out, out_rows=out_rows)
