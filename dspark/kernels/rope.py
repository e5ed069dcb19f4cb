"""Partial interleaved rotary embedding (deepseek_v4 spec §7.3) as one op.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``rope(x, cos, sin) -> y``: rotate the trailing rd = 2·cos.shape[-1] dims of x pairwise, pair i =
  (x[nope + 2i], x[nope + 2i + 1]) by the angle whose cos/sin are given: (e, o) -> (e·c − o·s,
  e·s + o·c), in fp32, rounded back to x's dtype; the leading nope = d − rd dims are copied.
  Passing −sin gives the inverse rotation. Same semantics as `deepseek_v4.rope.apply_rope`, which
  calls the registry's choice.

Shape: x [..., d] any float dtype; cos, sin fp32 [..., rd/2], each broadcastable to x's leading
dims (the models pass [N, rd/2] for x [N, d] and [N, 1, rd/2] for the heads of x [N, H, d]);
y [..., d] in x's dtype, a new contiguous tensor. Shape symbols: R = rows (the product of x's
leading dims), rd rotary dims, nope = d − rd.

Rounding: the reference is the models' former code op for op. The fused kernel does the same fp32
products, difference/sum and one cast, with FMA contraction off, so its result equals the
reference bit for bit on the GPU (under the CPU interpreter fp32 -> bf16 casts truncate, so bf16
outputs may be 1 ulp off there).

Autograd: the kernel has no backward; while autograd records (`autograd.records_grad`: x, cos or sin
requiring grad with grad mode on, i.e. training) `rope` runs `rope_ref`.

Fused kernel: one program per BLOCK_R rows copies the nope dims and rotates the pairs (even and odd
channels loaded as two strided vectors), reading each row's cos/sin through the broadcast
strides: no expanded copy of the tables. One launch replaces the reference's ~10 kernels (float
copy, four products, difference, sum, stack, cast, cat). BLOCK_R is a tile of ~4096 elements for
many rows but shrinks so that few rows still spread over >= ~`MIN_PROGRAMS` programs: the indexer q
of one decode token ([1, 64, 128], 64 rows) was one program of 64 rows (9.1 µs on the H200, graph
profile s9), now 32 programs of 2 rows. No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from dspark.kernels.autograd import records_grad
from dspark.kernels.registry import require_triton
from dspark.kernels.rope_ref import _check_args, rope_ref  # noqa: F401 (the op's ref)
from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue

_TILE_ELEMENTS = 4096  # elements per program at most: BLOCK_R rows of d channels
MIN_PROGRAMS = 32  # few rows are spread over about this many programs (a latency-bound launch)


@_jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, n_rows, dim, half, cos_inner, cos_outer_stride, cos_inner_stride,
                 sin_inner, sin_outer_stride, sin_inner_stride, BLOCK_R: tl.constexpr, BLOCK_NOPE: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    """y[r] = [x[r, :nope] | rotated pairs of x[r, nope:]] for BLOCK_R rows; x, y [R, d] contiguous.

    Row r's table row sits at (r // inner)·outer_stride + (r % inner)·inner_stride in cos (and in
    sin, with its own strides): the broadcast of the tables over x's leading dims, at most two
    strided dims after merging (`_table_strides`).
    """
    pdl_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * dim
    y_rows = y_ptr + rows64[:, None] * dim
    nope = dim - 2 * half
    if BLOCK_NOPE > 0:
        cols = tl.arange(0, BLOCK_NOPE)
        mask = row_mask[:, None] & (cols < nope)[None, :]
        tl.store(y_rows + cols[None, :], tl.load(x_rows + cols[None, :], mask=mask), mask=mask)
    pair = tl.arange(0, BLOCK_HALF)
    mask = row_mask[:, None] & (pair < half)[None, :]
    even_cols = nope + 2 * pair[None, :]
    e = tl.load(x_rows + even_cols, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(x_rows + even_cols + 1, mask=mask, other=0.0).to(tl.float32)
    cos_rows = (rows64 // cos_inner) * cos_outer_stride + (rows64 % cos_inner) * cos_inner_stride
    sin_rows = (rows64 // sin_inner) * sin_outer_stride + (rows64 % sin_inner) * sin_inner_stride
    c = tl.load(cos_ptr + cos_rows[:, None] + pair[None, :], mask=mask, other=1.0)
    s = tl.load(sin_ptr + sin_rows[:, None] + pair[None, :], mask=mask, other=0.0)
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_rows + even_cols, (e * c - o * s).to(out_ty), mask=mask)
    tl.store(y_rows + even_cols + 1, (e * s + o * c).to(out_ty), mask=mask)


@_jit
def rotate_pairs(x, c, s, rot):
    """x [R, 2P] fp32 with its pairs (2i, 2i+1) rotated by c / s (broadcastable to [R, P]) where rot [P], as
    `_rope_kernel` rotates them, for kernels compiled with FMA contraction on (the fused GEMV's and attention's
    epilogues): each product is an fma(a, b, +0), which rounds as the product (the sign of a zero aside: a pair
    whose two products are both zero may give +0 where `rope` gives -0) and cannot be contracted into the
    difference or the sum after it. The pairs are split in registers."""
    e, o = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))  # [R, P] each
    e_rot = tl.where(rot[None, :], tl.fma(e, c, 0.0) - tl.fma(o, s, 0.0), e)
    o_rot = tl.where(rot[None, :], tl.fma(e, s, 0.0) + tl.fma(o, c, 0.0), o)
    return tl.reshape(tl.join(e_rot, o_rot), (x.shape[0], x.shape[1]))


def _table_strides(table: torch.Tensor, lead: torch.Size) -> tuple[torch.Tensor, int, int, int]:
    """(table, inner, outer_stride, inner_stride) with table row (r // inner)·outer_stride +
    (r % inner)·inner_stride serving x's row r, for a table [..., rd/2] broadcast over x's leading
    dims `lead`. Broadcast dims have stride 0; adjacent dims whose strides chain are merged. A
    layout that keeps more than two strided dims is materialised as [R, rd/2] (rare; one copy).
    """
    table = table.float()
    if table.stride(-1) != 1:
        table = table.contiguous()
    try:
        expanded = table.expand(*lead, table.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"cos/sin of shape {tuple(table.shape)} do not broadcast to x's leading dims "
                         f"{tuple(lead)}") from e
    dims: list[list[int]] = []  # [size, stride], outermost first, size-1 dims dropped
    for size, stride in zip(expanded.shape[:-1], expanded.stride()[:-1]):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:  # the outer dim steps over this one exactly
            dims[-1] = [dims[-1][0] * size, stride]
        else:
            dims.append([size, stride])
    if len(dims) > 2:
        return expanded.reshape(-1, table.shape[-1]).contiguous(), 1, table.shape[-1], 0
    if not dims:
        return table, 1, 0, 0
    if len(dims) == 1:
        return table, dims[0][0], 0, dims[0][1]
    return table, dims[1][0], dims[0][1], dims[1][1]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Fused `rope_ref` (same signature, shapes and dtypes; the reference under autograd)."""
    if records_grad(x, cos, sin):
        return rope_ref(x, cos, sin)
    return launch_rope(x, cos, sin)


def rows_per_program(n_rows: int, width: int, min_programs: int) -> int:
    """BLOCK_R (a power of two): a tile of up to `_TILE_ELEMENTS` elements of `width` padded channels,
    fewer rows where that leaves fewer than ~`min_programs` programs (at least min_programs / 2)."""
    spread = triton.next_power_of_2(triton.cdiv(n_rows, max(1, min_programs)))
    return max(1, min(_TILE_ELEMENTS // width, spread))


def launch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                min_programs: int = MIN_PROGRAMS) -> torch.Tensor:
    """`rope` without the autograd rule, with an explicit program target (`rows_per_program`; the bench
    passes min_programs=1, the former launch shape: one tile of up to 4096 elements per program)."""
    require_triton()
    _check_args(x, cos, sin)
    lead, dim, half = x.shape[:-1], x.shape[-1], cos.shape[-1]
    cos, cos_inner, cos_outer, cos_step = _table_strides(cos, lead)
    sin, sin_inner, sin_outer, sin_step = _table_strides(sin, lead)
    rows = x.reshape(-1, dim).contiguous()  # [R, d]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = rows.shape[0]
    if n_rows == 0:
        return y
    nope = dim - 2 * half
    block_nope = triton.next_power_of_2(nope) if nope else 0
    block_half = triton.next_power_of_2(half)
    width = max(block_nope, 2 * block_half)
    block_r = rows_per_program(n_rows, width, min_programs)
    programs = triton.cdiv(n_rows, block_r)
    pdl = pdl_launch(x.device, programs)
    _rope_kernel[(programs,)](
        rows, cos, sin, y, n_rows, dim, half, cos_inner, cos_outer, cos_step, sin_inner, sin_outer, sin_step,
        BLOCK_R=block_r, BLOCK_NOPE=block_nope, BLOCK_HALF=block_half, PDL=pdl, launch_pdl=pdl,
        num_warps=min(4, max(1, block_r * width // 256)), enable_fp_fusion=False)  # 1 warp for a 2-row tile
    return y
