"""V4.1's cache quantisation-aware rounding (deepseek_v41 spec §11.3) as one kernel per call.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``cache_round(x, *, fmt) -> y``: x [..., d] rounded to what an FP8 / FP4 cache of `fmt` would hold
  and read back, in x's dtype; `fmt` one of `FORMATS` ("fp8_ue8m0": the window KV, FP8 e4m3 with a
  power-of-two scale per 32 values; "fp4_ue8m0": the indexer's q and keys, FP4 e2m1 with a
  power-of-two scale per 32; "fp4_e4m3": the compressed entries, FP4 e2m1 with an e4m3 scale per
  16). The formats and their edge rules are `dspark.models.deepseek_v41.qat`'s.

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


def _check_args(x: torch.Tensor, fmt: str) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
    block = FORMATS[fmt][0]
    if x.dim() < 1 or x.shape[-1] % block or not x.is_floating_point():
        raise ValueError(f"x must be a float [..., d] with d a multiple of {block} for {fmt}, got "
                         f"{tuple(x.shape)} {x.dtype}")
    return block


def cache_round_ref(x: torch.Tensor, *, fmt: str) -> torch.Tensor:
    """x [..., d] -> the values a `fmt` cache holds, [..., d] in x's dtype (torch, `qat.py`)."""
    _check_args(x, fmt)
    return _round_ref(x, fmt=fmt)


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
    r = ((tl.math.div_rn(a, unit) + 12582912.0) - 12582912.0) * unit
    return tl.where(v < 0, -r, r)


@_jit
def _round_e2m1(v):
    """`dspark.quant.round_e2m1`: magnitudes clamped to 6, units 0.5 / 1 / 2 below 2 / 4 / above."""
    m = tl.minimum(tl.abs(v), 6.0)
    unit = tl.where(m < 2.0, 0.5, tl.where(m >= 4.0, 2.0, 1.0))
    g = ((tl.math.div_rn(m, unit) + 12582912.0) - 12582912.0) * unit
    return tl.where(v < 0, -g, g)


@_jit
def _round_kernel(x_ptr, y_ptr, n_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr, FMT: tl.constexpr,
                  PDL: tl.constexpr):
    """ROWS blocks of BLOCK values per program: amax, scale, rounded values, written in y's dtype."""
    pdl_prologue(PDL)
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = offs_r.to(tl.int64)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (offs_r < n_blocks)[:, None]
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=1)
    if FMT == 0:  # FP8 e4m3, UE8M0 scale, amax >= 1e-4
        scale = _pow2_ceil(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
        out = _round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, scale[:, None]), -448.0), 448.0)) * scale[:, None]
    elif FMT == 1:  # FP4 e2m1, UE8M0 scale, amax >= 6·2^-126
        scale = _pow2_ceil(tl.math.div_rn(tl.maximum(amax, 7.052966104933725e-38), 6.0))
        out = _round_e2m1(tl.math.div_rn(v, scale[:, None])) * scale[:, None]
    else:  # FP4 e2m1, e4m3 scale, amax >= 6·2^-9
        scale = _round_e4m3(tl.math.div_rn(tl.maximum(amax, 0.01171875), 6.0))
        out = _round_e2m1(tl.math.div_rn(v, scale[:, None])) * scale[:, None]
    tl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=mask)


def cache_round(x: torch.Tensor, *, fmt: str) -> torch.Tensor:
    """Fused `cache_round_ref` (same signature): one launch, 64 blocks per program."""
    block = _check_args(x, fmt)
    if x.numel() == 0 or records_grad(x):  # the kernel has no backward
        return cache_round_ref(x, fmt=fmt)
    require_triton()
    x = x.contiguous()
    y = torch.empty_like(x)
    n_blocks, rows = x.numel() // block, 64
    programs = triton.cdiv(n_blocks, rows)
    pdl = pdl_launch(x.device, programs)
    _round_kernel[(programs,)](x, y, n_blocks, BLOCK=block, ROWS=rows, FMT=FORMATS[fmt][1], PDL=pdl, launch_pdl=pdl)
    return y
