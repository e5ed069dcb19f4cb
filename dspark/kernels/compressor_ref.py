"""Torch references of `compressor_pool` and `compressor_pool_gather` (see `compressor.py` for the ops
and their fused kernels).

Kept apart from the kernel module so that the models import it without importing Triton.
"""

from __future__ import annotations

import torch

from dspark.kernels.rope_ref import rope_ref


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


def _check_gather_args(kv_rows, score_rows, index, norm_weight, eps, out_dtype) -> None:
    if kv_rows.dim() != 2 or score_rows.shape != kv_rows.shape:
        raise ValueError(f"kv_rows and score_rows must be [R, d] of one shape, got {tuple(kv_rows.shape)} and "
                         f"{tuple(score_rows.shape)}")
    if index.dim() != 2 or index.dtype.is_floating_point:
        raise ValueError(f"index must be an integer [n, slots] tensor, got {tuple(index.shape)} {index.dtype}")
    _check_args(kv_rows.unsqueeze(0), score_rows.unsqueeze(0), norm_weight, eps, out_dtype)


def _check_dest(n, dim, out_dtype, cos_sin, out, out_rows) -> None:
    """The gather op's optional RoPE tables and destination (see `compressor_pool_gather_ref`)."""
    if cos_sin is not None:
        cos, sin = cos_sin
        if cos.dim() != 2 or cos.shape[0] != n or sin.shape != cos.shape or not 0 < 2 * cos.shape[1] <= dim:
            raise ValueError(f"cos_sin must be two [n={n}, rd/2] tables with rd <= d={dim}, got "
                             f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if (out is None) != (out_rows is None):
        raise ValueError("out and out_rows go together: pass both or neither")
    if out is None:
        return
    if out.dim() != 2 or out.shape[1] != dim or out.dtype != out_dtype:
        raise ValueError(f"out must be [R, d={dim}] {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    if out_rows.shape != (n,) or out_rows.dtype != torch.long:
        raise ValueError(f"out_rows must be long [n={n}], got {tuple(out_rows.shape)} {out_rows.dtype}")


def compressor_pool_gather_ref(kv_rows: torch.Tensor, score_rows: torch.Tensor, index: torch.Tensor,
                               norm_weight: torch.Tensor, *, eps: float, out_dtype: torch.dtype,
                               cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                               out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """`compressor_pool_ref` of slots gathered by row: kv_rows [R, d], score_rows [R, d] fp32 (e.g. a
    static state's rings viewed as rows), index [n, slots] rows of each entry's slots, −1 = an empty
    slot (value 0, logit −inf). Returns [n, d] in `out_dtype`.

    Optional, for the static step (its entries go straight to their rows, no copy launch after):
    cos_sin ([n, rd/2], [n, rd/2]) fp32 rotates each entry's trailing rd channels as the `rope` op
    does (after the norm's rounding); out [R', d] `out_dtype` with out_rows [n] long stores entry e
    at row out_rows[e] of out (an `index_copy_`; rows not named keep their values) and returns out.
    """
    _check_gather_args(kv_rows, score_rows, index, norm_weight, eps, out_dtype)
    _check_dest(index.shape[0], kv_rows.shape[1], out_dtype, cos_sin, out, out_rows)
    missing = (index < 0).unsqueeze(-1)
    rows = index.clamp(min=0)
    kv = kv_rows[rows].masked_fill(missing, 0)
    score = score_rows[rows].masked_fill(missing, float("-inf"))
    entries = compressor_pool_ref(kv, score, norm_weight, eps=eps, out_dtype=out_dtype)
    if cos_sin is not None:
        entries = rope_ref(entries, *cos_sin)
    return entries if out is None else out.index_copy_(0, out_rows, entries)
