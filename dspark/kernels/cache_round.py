"""V4.1's cache quantisation-aware rounding (deepseek_v41 spec §11.3) as one kernel per call.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``cache_round(x, *, fmt, out=None, out_rows=None) -> y``: x [..., d] rounded to what an FP8 / FP4
  cache of `fmt` would hold and read back, in x's dtype; `fmt` one of `FORMATS` ("fp8_ue8m0": the
  window KV, FP8 e4m3 with a power-of-two scale per 32 values; "fp4_ue8m0": the indexer's q and
  keys, FP4 e2m1 with a power-of-two scale per 32; "fp4_e4m3": the compressed entries, FP4 e2m1 with
  an e4m3 scale per 16). The formats and their edge rules are `dspark.models.deepseek_v41.qat`'s.
  With `out` [R, d] and `out_rows` [n] (x viewed as [n, d]), row i goes to out[out_rows[i]] in the
  kernel's own stores and `out` is returned: a static step writes its window rows without an
  `index_copy_` after the rounding.

The reference is ~15 torch ops per call and V4.1 rounds every cached vector of a step: about 660
launches of a v41-mini decode step (`bench/results/graph-profile-v41-mini-h200-final.json`: 1 707
kernels, 121 of them casts). The kernel reads each block once and writes it once. It rounds without
fp8 casts: each grid (e4m3: 3 mantissa bits, subnormal step 2^-9; e2m1) is a power-of-two unit per
binade, so |v| / unit is exact, rounding to the nearest integer (ties to even) is the fp32 magic-number
add, and scaling back is exact again: the same values as the reference's casts, on the GPU and under
the Triton interpreter alike. Every division is `div_rn` (IEEE, as torch's): Triton's `/` on fp32 is
the approximate `div.full`, which moved values across ties of the e4m3-scaled format on the H200.

Shape symbols: n blocks of `block` values (the last dim is a multiple of the block).
"""

from __future__ import annotations

import torch

from dspark.kernels.autograd import records_grad
from dspark.kernels.registry import require_triton
from dspark.models.deepseek_v41.qat import _round_ref

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue

# fmt -> (block, kernel code)
FORMATS = {"fp8_ue8m0": (32, 0), "fp4_ue8m0": (32, 1), "fp4_e4m3": (16, 2)}


def _check_args(x: torch.Tensor, fmt: str, out: torch.Tensor | None = None,
                out_rows: torch.Tensor | None = None) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
    block = FORMATS[fmt][0]
    if x.dim() < 1 or x.shape[-1] % block or not x.is_floating_point():
        raise ValueError(f"x must be a float [..., d] with d a multiple of {block} for {fmt}, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if (out is None) != (out_rows is None):
        raise ValueError("out and out_rows go together: pass both or neither")
    if out is not None:
        n = x.numel() // x.shape[-1]
        if out.dim() != 2 or out.shape[1] != x.shape[-1] or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [R, {x.shape[-1]}] tensor, got {tuple(out.shape)}")
        if out_rows.shape != (n,) or out_rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"out_rows must be [{n}] int32 / int64 (one row of out per row of x), got "
                             f"{tuple(out_rows.shape)} {out_rows.dtype}")
    return block


def cache_round_ref(x: torch.Tensor, *, fmt: str, out: torch.Tensor | None = None,
                    out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., d] -> the values a `fmt` cache holds, [..., d] in x's dtype (torch, `qat.py`); with
    `out` / `out_rows`, written to those rows of out (in out's dtype), which is returned."""
    _check_args(x, fmt, out, out_rows)
    return _round_ref(x, fmt=fmt, out=out, out_rows=out_rows)


# --------------------------------------------------------------------------------- Triton kernel

# 12582912.0 = 1.5 · 2^23 below: (v + M) − M is v rounded to an integer, ties to even, for |v| < 2^22.


@_jit
def _pow2_ceil(t):
    """2^ceil(log2 t) for positive normal fp32 t, from its bits (exact, as `qat._pow2_ceil`)."""
    bits = t.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@_jit
def _round_e4m3(v):
    """v rounded to the nearest e4m3 value (ties to even), fp32: per binade a unit of 2^(e − 3), at
    least 2^-9 (the subnormal step); magnitudes above 448 saturate, as torch's float8_e4m3fn cast does."""
    a = tl.minimum(tl.abs(v), 448.0)
    exponent = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # floor(log2 a), at least -6
    unit = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_unit = ((3 - exponent + 127) << 23).to(tl.float32, bitcast=True)  # 1 / unit exactly: 2^(3 − e)
    r = ((a * inv_unit + 12582912.0) - 12582912.0) * unit
    return tl.where(v < 0, -r, r)


@_jit
def _round_e2m1(v):
    """`dspark.quant.round_e2m1`: magnitudes clamped to 6, units 0.5 / 1 / 2 below 2 / 4 / above."""
    m = tl.minimum(tl.abs(v), 6.0)
    unit = tl.where(m < 2.0, 0.5, tl.where(m >= 4.0, 2.0, 1.0))
    g = ((m * (1.0 / unit) + 12582912.0) - 12582912.0) * unit  # 1 / unit is exact: 2, 1 or 0.5
    return tl.where(v < 0, -g, g)


@_jit
def _round_kernel(x_ptr, y_ptr, rows_ptr, n_blocks, blocks_per_row, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                  FMT: tl.constexpr, HAS_ROWS: tl.constexpr, PDL: tl.constexpr):
    """ROWS blocks of BLOCK values per program: amax, scale, rounded values, written in y's dtype
    (HAS_ROWS: block b of x's row r to the same block of y's row rows[r])."""
    pdl_prologue(PDL)
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = offs_r.to(tl.int64)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (offs_r < n_blocks)[:, None]
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    # A power-of-two scale divides exactly as a product with its reciprocal (one IEEE division per
    # block instead of one per value: the divisions were most of a small call's latency).
    if FMT == 0:  # FP8 e4m3, UE8M0 scale, amax >= 1e-4
        scale = _pow2_ceil(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
        inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
        out = _round_e4m3(tl.minimum(tl.maximum(v * inv, -448.0), 448.0)) * scale[:, None]
    elif FMT == 1:  # FP4 e2m1, UE8M0 scale, amax >= 6·2^-126
        scale = _pow2_ceil(tl.math.div_rn(tl.maximum(amax, 7.052966104933725e-38), 6.0))
        inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
        out = _round_e2m1(v * inv) * scale[:, None]
    else:  # FP4 e2m1, e4m3 scale, amax >= 6·2^-9
        scale = _round_e4m3(tl.math.div_rn(tl.maximum(amax, 0.01171875), 6.0))
        out = _round_e2m1(tl.math.div_rn(v, scale[:, None])) * scale[:, None]
    if HAS_ROWS:
        row = offs_r // blocks_per_row
        dest = tl.load(rows_ptr + row, mask=offs_r < n_blocks, other=0).to(tl.int64)
        block_in_row = (offs_r - row * blocks_per_row).to(tl.int64)
        offs = (dest * blocks_per_row + block_in_row)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    tl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=mask)


def cache_round(x: torch.Tensor, *, fmt: str, out: torch.Tensor | None = None,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Fused `cache_round_ref` (same signature): one launch of `round_rows` blocks per program."""
    return launch_cache_round(x, fmt, out, out_rows, None)


def round_rows(n_blocks: int) -> int:
    """Blocks per program of a call rounding `n_blocks` blocks: 8 for a decode step's few rows (its
    calls are latency-bound: spread over more programs, one H100 `select-round-sweep-h100-s27.json`,
    e.g. one compressed entry 2.35 -> 1.45 µs), 64 for prefill-sized calls as before."""
    return 8 if n_blocks <= 4096 else 64


def launch_cache_round(x: torch.Tensor, fmt: str, out: torch.Tensor | None, out_rows: torch.Tensor | None,
                       rows: int | None) -> torch.Tensor:
    """`cache_round` by programs of `rows` blocks (a power of two; default `round_rows`; the bench
    `bench/select_round_sweep.py` times the others)."""
    block = _check_args(x, fmt, out, out_rows)
    if rows is not None and (rows < 1 or rows & (rows - 1)):
        raise ValueError(f"rows must be a power of two, got {rows!r}")
    if x.numel() == 0 or records_grad(x):  # the kernel has no backward
        return cache_round_ref(x, fmt=fmt, out=out, out_rows=out_rows)
    require_triton()
    x = x.contiguous()
    y = torch.empty_like(x) if out is None else out
    n_blocks = x.numel() // block
    rows = rows or round_rows(n_blocks)
    programs = triton.cdiv(n_blocks, rows)
    pdl = pdl_launch(x.device, programs)
    _round_kernel[(programs,)](x, y, out_rows if out is not None else x, n_blocks, x.shape[-1] // block, BLOCK=block,
                               ROWS=rows, FMT=FORMATS[fmt][1], HAS_ROWS=out is not None, PDL=pdl, launch_pdl=pdl)
    return y
