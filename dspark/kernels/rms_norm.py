"""RMS normalisation over the last dim (deepseek_v4 spec §5): weighted RMSNorm and unweighted scaling.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``rms_norm(x, weight, *, eps, out_dtype) -> y``: y = weight ⊙ x · rsqrt(mean(x²) + eps) over the
  last dim, statistics and products in fp32, rounded once to `out_dtype`. ``weight=None`` drops the
  weight (the unweighted RMS scaling). The models call it as `RMSNorm` (out_dtype = x.dtype), as
  `rms_scale` (no weight, fp32 out) and as V4's per-head q norm (no weight, out_dtype = x.dtype).

Shape: x [..., D] any float dtype (any D, odd included); weight [D] fp32 or None; y [..., D] in
out_dtype, a new contiguous tensor. Shape symbols: M = rows (the product of the leading dims).

Rounding: the reference is the models' former code op for op (fp32 cast, square, mean, + eps,
rsqrt, x · r, weight · (x · r), one cast). The fused kernel does the same operations in the same
order with FMA contraction off, so the two can differ only where the sum of squares is reduced in
another order or rsqrt rounds its last bit differently: ~1 fp32 ulp of r, then at most 1 ulp of
out_dtype per element (bf16 outputs are almost always equal).

Autograd: the kernel has no backward; called while autograd records (`autograd.records_grad`:
grad mode on and x or weight requiring grad, i.e. training) `rms_norm` runs `rms_norm_ref`.

Fused kernel: one program per BLOCK_M rows; a row that fits one tile (D ≤ 8192: every norm of the
V4 models) is read once and kept in registers, wider rows are read twice (Σx², then scale). One
launch replaces the reference's ~8 elementwise kernels. No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from dspark.kernels.autograd import records_grad
from dspark.kernels.registry import require_triton
from dspark.kernels.rms_norm_ref import _check_args, rms_norm_ref  # noqa: F401 (the op's ref)
from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue

_MAX_TILE = 8192  # widest row kept in registers (V4-Pro hidden 7168)
_TILE_ELEMENTS = 4096  # elements per program: BLOCK_M rows of a narrow D share one program


@_jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n_rows, dim, stride_x, eps, BLOCK_M: tl.constexpr,
                     BLOCK_D: tl.constexpr, ONE_TILE: tl.constexpr, HAS_WEIGHT: tl.constexpr, PDL: tl.constexpr):
    """y[m] = [w ⊙] x[m] · rsqrt(Σ x[m]² / D + eps) for BLOCK_M rows. x [M, D] with row stride
    `stride_x`, y [M, D] contiguous; ONE_TILE: D ≤ BLOCK_D, the row stays in registers."""
    pdl_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    y_rows = y_ptr + rows.to(tl.int64)[:, None] * dim
    cols = tl.arange(0, BLOCK_D)
    if ONE_TILE:
        mask = row_mask[:, None] & (cols < dim)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) / dim + eps)  # [BLOCK_M]
        _scale_store(x, r, w_ptr, y_rows, cols, cols < dim, mask, HAS_WEIGHT)
    else:
        squares = tl.zeros((BLOCK_M,), tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            mask = row_mask[:, None] & (d0 + cols < dim)[None, :]
            x = tl.load(x_rows + d0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        r = tl.math.rsqrt(squares / dim + eps)
        for d0 in range(0, dim, BLOCK_D):
            mask = row_mask[:, None] & (d0 + cols < dim)[None, :]
            x = tl.load(x_rows + d0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            _scale_store(x, r, w_ptr + d0, y_rows + d0, cols, d0 + cols < dim, mask, HAS_WEIGHT)


@_jit
def _scale_store(x, r, w_ptr, y_rows, cols, col_mask, mask, HAS_WEIGHT: tl.constexpr):
    """Store [w ⊙] (x · r) for one tile, in the reference's order (x · r first, then the weight)."""
    y = x * r[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
        y = w[None, :] * y
    tl.store(y_rows + cols[None, :], y.to(y_rows.dtype.element_ty), mask=mask)


def _tiles(n_rows: int, dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, num_warps): the whole row in one tile up to `_MAX_TILE`, several rows per
    program for narrow rows (per-head q norm: D 512), ~`_TILE_ELEMENTS` elements per program."""
    block_d = min(triton.next_power_of_2(dim), _MAX_TILE)
    block_m = max(1, min(_TILE_ELEMENTS // block_d, triton.next_power_of_2(n_rows)))
    return block_m, block_d, 4 if block_m * block_d <= _TILE_ELEMENTS else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, *, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """Fused `rms_norm_ref` (same signature, shapes and dtypes; the reference under autograd)."""
    if records_grad(x, weight):
        return rms_norm_ref(x, weight, eps=eps, out_dtype=out_dtype)
    require_triton()
    _check_args(x, weight, out_dtype)
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)  # a view when the leading dims merge; a copy otherwise
    if dim > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n_rows = rows.shape[0]
    if n_rows == 0 or dim == 0:
        return y
    block_m, block_d, warps = _tiles(n_rows, dim)
    w = rows if weight is None else weight.float().contiguous()  # a dummy pointer when unweighted
    programs = triton.cdiv(n_rows, block_m)
    pdl = pdl_launch(x.device, programs)
    _rms_norm_kernel[(programs,)](
        rows, w, y, n_rows, dim, rows.stride(0), eps, BLOCK_M=block_m, BLOCK_D=block_d, ONE_TILE=dim <= block_d,
        HAS_WEIGHT=weight is not None, PDL=pdl, launch_pdl=pdl, num_warps=warps, enable_fp_fusion=False)
    return y
