"""RMS normalisation then partial RoPE of attention's q heads and kv latents (deepseek_v4 spec §5,
§7.3) as one op, optionally storing the rows where they live.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``norm_rope(x, weight, cos, sin, *, eps, out=None, out_rows=None) -> y``: each row of x (a head of
  q, a kv latent) RMS-normalised over its last dim as ``rms_norm(x, weight, eps=eps,
  out_dtype=x.dtype)`` (``weight=None``: V4's unweighted per-head q norm), then its trailing rd =
  2·cos.shape[-1] dims rotated as ``rope(·, cos, sin)``. With ``out`` / ``out_rows`` row m of y
  (y viewed as [M, d]) is also stored at row out_rows[m] of out (the static decode step's window
  ring viewed as rows): no `index_copy_` after the op. y is always returned (the dynamic path
  attends over it; one extra row store).

Shape: x [..., d] any float dtype (d ≤ 8192 for the kernel); weight [d] fp32 or None; cos, sin fp32
[..., rd/2] broadcastable to x's leading dims as for `rope` (q [N, H, d] with [N, 1, rd/2], kv [N, d]
with [N, rd/2]); out [R, d] in x's dtype with contiguous rows, out_rows [M] long (distinct rows);
y [..., d] in x's dtype, a new contiguous tensor. Shape symbols: M = rows (the product of x's leading
dims), rd rotary dims, nope = d − rd.

Rounding: the rounding points of the two ops in sequence: the normalised row is rounded to x's dtype,
then the pairs are rotated in fp32 and rounded again. The kernel is `rms_norm`'s (same tiles, same
Σx² reduction over the same [BLOCK_M, BLOCK_D] tile, rsqrt, x · r then the weight) followed by
`rope`'s products, both with FMA contraction off, so it is meant to equal `rope(rms_norm(x))` of the
two fused ops bit for bit on the GPU, and `rope_ref(rms_norm_ref(x))` up to `rms_norm`'s own
difference from its reference (the order of the Σx² reduction and rsqrt's last bit: ~1 ulp).

Autograd: the kernel has no backward; while autograd records (`autograd.records_grad`) `norm_rope`
runs `norm_rope_ref`.

Fused kernel: one program per BLOCK_M rows reads each row once for Σx² and the unrotated channels,
re-reads its rotary pairs as even / odd vectors (a cache hit; any nope parity works), and reads each
row's cos/sin through the broadcast strides (`rope._table_strides`). One launch replaces the two ops'
two launches, and with `out` the `index_copy_` after them. No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from dspark.kernels.autograd import records_grad
from dspark.kernels.norm_rope_ref import _check_args, norm_rope_ref
from dspark.kernels.registry import require_triton
from dspark.kernels.rms_norm import _MAX_TILE, _tiles
from dspark.kernels.rope import _table_strides
from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue

__all__ = ["norm_rope", "norm_rope_ref"]


@_jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, out_ptr, rows_ptr, n_rows, dim, half, stride_x,
                      stride_out, eps, cos_inner, cos_outer_stride, cos_inner_stride, sin_inner, sin_outer_stride,
                      sin_inner_stride, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
                      HAS_WEIGHT: tl.constexpr, SCATTER: tl.constexpr, PDL: tl.constexpr):
    """y[m] = rope(round([w ⊙] x[m] · rsqrt(Σ x[m]² / d + eps))) for BLOCK_M rows (and out[rows[m]] =
    y[m] with SCATTER). x [M, d] with row stride `stride_x`, y [M, d] contiguous, d ≤ BLOCK_D; row m's
    table row: (m // inner)·outer_stride + (m % inner)·inner_stride, as in `rope`'s kernel."""
    pdl_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * stride_x
    y_rows = y_ptr + rows64[:, None] * dim
    out_rows = y_rows  # unused without SCATTER
    if SCATTER:
        out_rows = out_ptr + tl.load(rows_ptr + rows64, mask=row_mask, other=0)[:, None] * stride_out
    out_ty = y_ptr.dtype.element_ty
    nope = dim - 2 * half
    # rms_norm's statistic, over the whole row in registers
    cols = tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (cols < dim)[None, :]
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) / dim + eps)  # [BLOCK_M]
    nope_mask = row_mask[:, None] & (cols < nope)[None, :]
    normed = _scaled(x, r, w_ptr, cols, cols < nope, HAS_WEIGHT).to(out_ty)  # rope copies these channels
    _store(y_rows, out_rows, cols[None, :], normed, nope_mask, SCATTER)
    # the rotary pairs, normalised and rounded as above, then rotated as in `rope`'s kernel
    pair = tl.arange(0, BLOCK_HALF)
    pair_ok = pair < half
    pair_mask = row_mask[:, None] & pair_ok[None, :]
    even_cols = nope + 2 * pair
    e = tl.load(x_rows + even_cols[None, :], mask=pair_mask, other=0.0).to(tl.float32)
    o = tl.load(x_rows + even_cols[None, :] + 1, mask=pair_mask, other=0.0).to(tl.float32)
    e = _scaled(e, r, w_ptr, even_cols, pair_ok, HAS_WEIGHT).to(out_ty).to(tl.float32)
    o = _scaled(o, r, w_ptr, even_cols + 1, pair_ok, HAS_WEIGHT).to(out_ty).to(tl.float32)
    cos_rows = (rows64 // cos_inner) * cos_outer_stride + (rows64 % cos_inner) * cos_inner_stride
    sin_rows = (rows64 // sin_inner) * sin_outer_stride + (rows64 % sin_inner) * sin_inner_stride
    c = tl.load(cos_ptr + cos_rows[:, None] + pair[None, :], mask=pair_mask, other=1.0)
    s = tl.load(sin_ptr + sin_rows[:, None] + pair[None, :], mask=pair_mask, other=0.0)
    even = (e * c - o * s).to(out_ty)
    odd = (e * s + o * c).to(out_ty)
    _store(y_rows, out_rows, even_cols[None, :], even, pair_mask, SCATTER)
    _store(y_rows, out_rows, even_cols[None, :] + 1, odd, pair_mask, SCATTER)


@_jit
def _store(y_rows, out_rows, cols, values, mask, SCATTER: tl.constexpr):
    """values [BLOCK_M, C] at channels `cols` of the rows of y and, with SCATTER, of their out rows."""
    tl.store(y_rows + cols, values, mask=mask)
    if SCATTER:
        tl.store(out_rows + cols, values, mask=mask)


@_jit
def _scaled(x, r, w_ptr, cols, col_mask, HAS_WEIGHT: tl.constexpr):
    """[w ⊙] (x · r) in fp32, in `rms_norm`'s order (x · r first, then the weight); x [BLOCK_M, C],
    cols [C] its channels."""
    y = x * r[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
        y = w[None, :] * y
    return y


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *, eps: float,
              out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Fused `norm_rope_ref` (same signature, shapes and dtypes; the reference under autograd)."""
    if records_grad(x, weight, cos, sin):
        return norm_rope_ref(x, weight, cos, sin, eps=eps, out=out, out_rows=out_rows)
    require_triton()
    _check_args(x, weight, cos, sin, out, out_rows)
    lead, dim, half = x.shape[:-1], x.shape[-1], cos.shape[-1]
    if dim > _MAX_TILE:
        raise ValueError(f"norm_rope's kernel keeps a row in registers: d={dim} exceeds {_MAX_TILE} "
                         f"(use rms_norm and rope)")
    cos, cos_inner, cos_outer, cos_step = _table_strides(cos, lead)
    sin, sin_inner, sin_outer, sin_step = _table_strides(sin, lead)
    rows = x.reshape(-1, dim)  # a view when the leading dims merge; a copy otherwise
    if dim > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = rows.shape[0]
    if n_rows == 0:
        return y
    block_m, block_d, warps = _tiles(n_rows, dim)  # rms_norm's tiles: the same Σx² reduction
    w = rows if weight is None else weight.float().contiguous()  # a dummy pointer when unweighted
    scatter = out is not None
    dest, dest_rows = (out, out_rows.contiguous()) if scatter else (y, rows)  # dummies without SCATTER
    programs = triton.cdiv(n_rows, block_m)
    pdl = pdl_launch(x.device, programs)
    _norm_rope_kernel[(programs,)](
        rows, w, cos, sin, y, dest, dest_rows, n_rows, dim, half, rows.stride(0), dest.stride(0), eps, cos_inner,
        cos_outer, cos_step, sin_inner, sin_outer, sin_step, BLOCK_M=block_m, BLOCK_D=block_d,
        BLOCK_HALF=triton.next_power_of_2(half), HAS_WEIGHT=weight is not None, SCATTER=scatter, PDL=pdl,
        launch_pdl=pdl, num_warps=warps, enable_fp_fusion=False)
    return y
