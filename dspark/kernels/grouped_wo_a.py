"""Attention output projection, first half (deepseek_v4 spec §7.5): inverse RoPE + grouped `wo_a`.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``grouped_wo_a(out, cos, sin, weight) -> y``: undo the rotation that the values carried into the
  attention output (angle −p·θ on the last rd dims of each head, at the query position p), split
  the heads into G groups of H/G consecutive heads and project group g with its own row block
  ``weight[g·R:(g+1)·R]`` (block-diagonal `wo_a`). Returns y [N, G·R] token-major: row n is
  [y_0 | y_1 | … | y_{G−1}], `wo_b`'s input.

Shape: out [N, H, d] bf16/fp32 (contiguous); cos, sin [N, rd/2] fp32 (`Rope.cos_sin` of the query
positions: the op negates sin itself); weight [G·R, H·d/G] in out's dtype (V4-Flash [8192, 4096]:
H 64, d 512, G 8, R 1024; under tensor parallelism a rank's row block [G/t·R, H·d/G] with its
H/t heads). G = H·d / weight.shape[1]. y [N, G·R] in out's dtype.

Shape symbols: N rows, H heads, d head_dim, rd rotary dims, G groups, K = H·d/G group width,
R o_lora_rank.

Rounding: the reference is the models' code op for op (rotation in fp32, rounded to out's dtype;
then the einsum's batched GEMM with fp32 accumulation, rounded once). The fused kernel does the
same rotation per operand tile, rounds it to out's dtype before the dot (as the reference does)
and accumulates in fp32, so in bf16 the two differ only by the GEMM's summation order (and cuBLAS's
optional reduced-precision split-K), i.e. within 1 bf16 ulp per element.

Fused kernel: one program per [BLOCK_M rows × BLOCK_N outputs] tile of one group; it streams the
group's weight rows and the rows' K activations: first a plain pipelined GEMM over every head's
"nope" channels, then each head's rotary tile, rotated in registers (pairs split in place, cos/sin
of the tile's rows) before its dot; it accumulates in fp32 and writes its tile
straight into y's token-major layout. This replaces the reference's rotation passes (slice, stack,
cat), the batched GEMM over a [G, N, K] view and the [G, N, R] -> [N, G·R] transposing copy with one
launch. At decode sizes each group's heads are split into runs (`decode_splits`): more programs, each
streaming fewer weight rows, then a second launch adds the runs' fp32 partials in order. At one
bf16 row (GEMV_ROWS; weights up to GEMV_MAX_ELEMENTS) the op is instead one GEMV launch
(`_wo_a_gemv_kernel`: `linear`'s CUDA-core accumulators, the rotary channels rotated per element), no
partials to add. No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dspark.kernels.registry import require_triton
from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.linear import GEMV_MAX_ROWS, _num_sms, _rows_times_tile, gemv_tiles
from dspark.kernels.triton_compat import pdl_launch, pdl_prefetch, pdl_prologue, prefetch_launch


# The most rows `grouped_wo_a` runs as one GEMV launch (bf16 / fp16; `launch_wo_a_gemv` takes up to
# linear.GEMV_MAX_ROWS) instead of the split tensor-core kernel and its partial-sum launch. One H100,
# graph steps timed in turn against the split kernel at every row count (`bench/graph_decode.py --gemv-ab`,
# gemv-wo-a-ab-*-h100-s38.json): one row 1.012x (v4-mini) / 1.009x (v41-mini) faster; 2 rows 0.981x,
# 4 rows (4 requests, or one 4-token verify block) 0.86x. So one row only, and only on weights of at most
# GEMV_MAX_ELEMENTS (v4-mini's and v41-mini's [2048, 4096]): V4-Flash's [8192, 4096] was not timed in a
# step, and on weights that large the GEMV streams slower than the tensor cores (`linear`: the LM heads).
GEMV_ROWS = 1
GEMV_MAX_ELEMENTS = 8 << 20


def _check_args(out, cos, sin, weight) -> int:
    """Validate the operands; returns G."""
    if out.dim() != 3:
        raise ValueError(f"out must be [N, H, d], got shape {tuple(out.shape)}")
    n, heads, head_dim = out.shape
    if cos.dim() != 2 or cos.shape[0] != n or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must both be [N={n}, rd/2], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if 2 * cos.shape[1] > head_dim or head_dim % 2:
        raise ValueError(f"rotary dims 2·{cos.shape[1]} must fit the even head_dim {head_dim}")
    if weight.dim() != 2 or weight.shape[1] == 0 or (heads * head_dim) % weight.shape[1]:
        raise ValueError(f"weight must be [G·R, H·d/G] with H·d={heads * head_dim}, got {tuple(weight.shape)}")
    groups = heads * head_dim // weight.shape[1]
    if weight.shape[0] % groups:
        raise ValueError(f"weight rows {weight.shape[0]} are not G={groups} blocks of R rows")
    if weight.dtype != out.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must equal out's dtype {out.dtype}")
    return groups


def grouped_wo_a_ref(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Inverse RoPE, then the block-diagonal `wo_a`: out [N, H, d] -> [N, G·R] (see the module docstring).

    The models' own code, op for op: the rotation mirrors `deepseek_v4.rope.apply_rope(out, cos, −sin)`
    (fp32, cast back to out's dtype) and the projection is the einsum "ngk,grk->ngr".
    """
    groups = _check_args(out, cos, sin, weight)
    rd = 2 * cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), -sin.unsqueeze(-2)  # [N, 1, rd/2]: every head of a row, angle −p·θ
    nope, rot = out[..., :-rd], out[..., -rd:].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]  # [N, H, rd/2] each
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    o = torch.cat((nope, rotated.to(out.dtype)), dim=-1).reshape(out.shape[0], groups, -1)  # [N, G, K]
    w = weight.view(groups, weight.shape[0] // groups, -1)  # [G, R, K]
    return torch.einsum("ngk,grk->ngr", o, w).flatten(1)


@_jit
def _wo_a_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, y_ptr, n_rows, rank, width, head_dim, nope, stride_cs,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr,
                 PRECISION: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    """y[m, g·R + r] = Σ_k rot(x)[m, g, k] · w[g·R + r, k] for one [BLOCK_M, BLOCK_N] tile of group g.

    x [N, G·K] (= out [N, H, d]), w [G·R, K], y [N, G·R]. ALIGNED (the V4 layout, d 512 = 448 + 64):
    BLOCK_K = rd and rd divides the nope width, so each head's rotary dims are exactly one K tile,
    rotated in registers; otherwise every tile is rotated under masks (small test shapes).
    (Rotating a tile conditionally inside one K loop made the sm_90 build spill registers at the
    64- and 128-row tiles: the dot could no longer take its operands straight from shared memory.)
    PRECISION: "ieee" for fp32 operands (a true fp32 GEMM, like torch's default), ignored for bf16.
    SPLITS > 1 (ALIGNED only): program axis 1 also picks one of SPLITS equal runs of the group's heads
    and y is fp32 partials [SPLITS, N, G·R] that `_sum_splits_kernel` adds up.
    """
    pdl_prologue(PDL)
    pid_m, pid_ns, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_n, split = pid_ns // SPLITS, pid_ns % SPLITS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < n_rows, offs_n < rank
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * (width * tl.num_programs(2)) + g * width
    w_cols = w_ptr + (g * rank + offs_n).to(tl.int64)[None, :] * width
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if ALIGNED:
        # Two loops, so that the GEMM over the "nope" channels (7/8 of K in V4) stays a plain
        # pipelined dot: first every head's nope tiles, then every head's rotary tile, rotated.
        nope_tiles = nope // BLOCK_K
        split_width = width // SPLITS  # whole heads: the launcher checks that SPLITS divides them
        first = split * split_width
        for t in range(0, (split_width // head_dim) * nope_tiles):
            offs_k = first + (t // nope_tiles) * head_dim + (t % nope_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            b = tl.load(w_cols + offs_k[:, None], mask=n_mask[None, :], other=0.0)  # [K, N] tile
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        for k0 in range(nope, split_width, head_dim):
            offs_k = first + k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            a = _rotate_tile(a, cos_ptr, sin_ptr, offs_m, m_mask, stride_cs)
            b = tl.load(w_cols + offs_k[:, None], mask=n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    else:
        for k0 in range(0, width, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < width
            a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = _rotate_masked(a, x_rows, cos_ptr, sin_ptr, offs_m, offs_k, m_mask, k_mask, head_dim, nope,
                               stride_cs)
            b = tl.load(w_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    y = y_ptr + offs_m.to(tl.int64)[:, None] * (rank * tl.num_programs(2)) + g * rank + offs_n[None, :]
    if SPLITS > 1:
        y += split.to(tl.int64) * n_rows * rank * tl.num_programs(2)
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@_jit
def _wo_a_gemv_kernel(x_ptr, cos_ptr, sin_ptr, w_ptr, y_ptr, n_rows, rank, width, head_dim, nope, stride_cs,
                      ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                      PDL: tl.constexpr):
    """`_wo_a_kernel`'s sums for the n_rows (<= ROWS) decode rows and the BLOCK_N weight rows of program
    (n, g), on the CUDA cores (`linear._gemv_kernel`'s accumulators): each weight tile is read once
    and multiplied with every row; x's rotary channels are rotated per tile (pair partner and cos/sin
    loaded per element: x is a few KB, L1-resident) and rounded to x's dtype, as the reference does."""
    g = tl.program_id(1)
    first = tl.program_id(0) * BLOCK_N
    offs_n = first + tl.arange(0, BLOCK_N)
    n_mask = offs_n < rank
    if PREFETCH:
        rows_here = tl.minimum(BLOCK_N, rank - first)
        pdl_prefetch(w_ptr + (g * rank + first).to(tl.int64) * width,
                     rows_here * width * (w_ptr.dtype.element_ty.primitive_bitwidth // 8), PDL)
    pdl_prologue(PDL)
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < n_rows
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None, None] * (width * tl.num_programs(1)) + g * width
    w_rows = (g * rank + offs_n).to(tl.int64)[None, :, None] * width
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < width
        j = offs_k % head_dim - nope  # index inside the head's rotary dims, < 0 for "nope" channels
        rot = m_mask[:, None, None] & ((j >= 0) & k_mask)[None, None, :]
        x = tl.load(x_rows + offs_k[None, None, :], mask=m_mask[:, None, None] & k_mask[None, None, :], other=0.0)
        partner = tl.load(x_rows + (offs_k ^ 1)[None, None, :], mask=rot, other=0.0).to(tl.float32)
        cs = offs_m[:, None, None] * stride_cs + (tl.maximum(j, 0) // 2)[None, None, :]
        c = tl.load(cos_ptr + cs, mask=rot, other=1.0)
        sn = tl.load(sin_ptr + cs, mask=rot, other=0.0)
        sign = tl.where(offs_k % 2 == 0, 1.0, -1.0)[None, None, :]
        x = (x.to(tl.float32) * c + sign * (partner * sn)).to(x_ptr.dtype.element_ty).to(tl.float32)
        acc = _rows_times_tile(acc, x, w_ptr, w_rows, offs_k[None, None, :],
                               n_mask[None, :, None] & k_mask[None, None, :])
    y = tl.sum(acc, axis=2)
    out = y_ptr + offs_m.to(tl.int64)[:, None] * (rank * tl.num_programs(1)) + g * rank + offs_n[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@_jit
def _sum_splits_kernel(part_ptr, y_ptr, n_elems, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y = Σ_s part[s] (fp32, in split order: deterministic), cast to y's dtype."""
    pdl_prologue(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elems
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * n_elems + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@_jit
def _rotate_tile(a, cos_ptr, sin_ptr, offs_m, m_mask, stride_cs):
    """a [BLOCK_M, rd] (one head's rotary dims) rotated by −p·θ in fp32, rounded back to a's dtype
    (as the reference rounds before its GEMM): pair i = (e, o) -> (e·cos + o·sin, o·cos − e·sin).
    The pairs are split in registers; cos/sin [BLOCK_M, rd/2] are the rows' own (L2-resident)."""
    half: tl.constexpr = a.shape[1] // 2
    even, odd = tl.split(tl.reshape(a.to(tl.float32), (a.shape[0], half, 2)))  # [BLOCK_M, rd/2] each
    cs = offs_m[:, None] * stride_cs + tl.arange(0, half)[None, :]
    c = tl.load(cos_ptr + cs, mask=m_mask[:, None], other=1.0)
    s = tl.load(sin_ptr + cs, mask=m_mask[:, None], other=0.0)
    pairs = tl.join(even * c + odd * s, odd * c - even * s)  # [BLOCK_M, rd/2, 2]
    return tl.reshape(pairs, (a.shape[0], a.shape[1])).to(a.dtype)


@_jit
def _rotate_masked(a, x_rows, cos_ptr, sin_ptr, offs_m, offs_k, m_mask, k_mask, head_dim, nope, stride_cs):
    """`_rotate_tile` for a tile [BLOCK_M, BLOCK_K] at any alignment: channels k with k mod d ≥ nope
    are rotated (partner channel k ^ 1 and cos/sin loaded per element), the others pass unchanged."""
    j = offs_k % head_dim - nope  # index inside the head's rotary dims, < 0 for "nope" channels
    mask = m_mask[:, None] & ((j >= 0) & k_mask)[None, :]
    partner = tl.load(x_rows + (offs_k ^ 1)[None, :], mask=mask, other=0.0).to(tl.float32)  # the pair's other half
    cs = offs_m[:, None] * stride_cs + (tl.maximum(j, 0) // 2)[None, :]
    c = tl.load(cos_ptr + cs, mask=mask, other=1.0)
    s = tl.load(sin_ptr + cs, mask=mask, other=0.0)
    sign = tl.where(offs_k % 2 == 0, 1.0, -1.0)[None, :]  # nope is even, so offs_k's parity is the pair's
    return (a.to(tl.float32) * c + sign * (partner * s)).to(a.dtype)


class Tiles(NamedTuple):
    """Launch shape: [block_m × block_n] output tiles, block_k reduction step, warps, pipeline stages,
    and `splits`: the group's heads split into this many runs whose fp32 partials a second launch adds
    (decode: more programs, each a shorter stream of weight rows)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    splits: int = 1


def decode_splits(rank: int) -> int:
    """Runs of a group's heads at decode sizes, measured (bench/decode_sweep.py, one H200, 1 and 8
    tokens, 8 heads per group, 32-wide N tiles): v4-mini (R 512) 4 runs 12.1 µs vs 20.7 unsplit,
    V4-Flash (R 1024, twice the N tiles) 2 runs 28.0 µs vs 33.3."""
    return 4 if rank <= 512 else 2


def default_tiles(n: int, groups: int, rank: int, heads_per_group: int, head_dim: int, rd: int,
                  dtype: torch.dtype) -> Tiles:
    """`Tiles` by token count: decode tiles stream the weight over many programs (memory bound; split
    over runs of the group's heads, `decode_splits`, where they divide them, with 32-wide N tiles),
    prefill tiles are square for tensor-core reuse."""
    block_m, block_n, block_k, warps, stages, aligned = _tiles(n, groups * rank, head_dim, rd, dtype)
    splits = decode_splits(rank)
    if aligned and n <= 64 and dtype != torch.float32 and heads_per_group % splits == 0:
        return Tiles(block_m, 32, block_k, warps, stages, splits)
    return Tiles(block_m, block_n, block_k, warps, stages, 1)


def _aligned(head_dim: int, rd: int) -> bool:
    return rd >= 16 and rd & (rd - 1) == 0 and (head_dim - rd) % rd == 0  # V4: rd 64, nope 448


def _tiles(n: int, rows: int, head_dim: int, rd: int, dtype: torch.dtype) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, ALIGNED) by token count: decode tiles stream
    the weight over many programs (memory bound); prefill tiles are square for tensor-core reuse."""
    aligned = _aligned(head_dim, rd)
    block_k = rd if aligned else 32
    if dtype == torch.float32:  # ieee fp32 dots run on the FMA units: small tiles (tests, fp32 models)
        return min(32, max(16, triton.next_power_of_2(n))), 32, block_k, 4, 2, aligned
    if n <= 64:  # decode / verify: a thin M tile, narrow N tiles so that ≥ ~128 programs read weight rows
        return max(16, triton.next_power_of_2(n)), 32 if rows >= 8192 else 16, block_k, 4, 4, aligned
    # 8 warps: with 4 (64 × 64) or a 128 × 128 tile the rotary tile's temporaries spill on sm_90.
    if n <= 256:
        return 64, 64, block_k, 8, 3, aligned
    return 128, 64, block_k, 8, 3, aligned


def grouped_wo_a(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Fused `grouped_wo_a_ref` (same signature, shapes and dtypes)."""
    groups = _check_args(out, cos, sin, weight)
    n, heads, head_dim = out.shape
    if 1 <= n <= GEMV_ROWS and out.dtype != torch.float32 and weight.numel() <= GEMV_MAX_ELEMENTS:
        return launch_wo_a_gemv(out, cos, sin, weight)
    tiles = default_tiles(n, groups, weight.shape[0] // groups, heads // groups, head_dim, 2 * cos.shape[1],
                          out.dtype)
    return launch_grouped_wo_a(out, cos, sin, weight, tiles)


def launch_wo_a_gemv(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                     tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """`grouped_wo_a` for 1 to `linear.GEMV_MAX_ROWS` rows as a GEMV (`_wo_a_gemv_kernel`, one launch, no
    head splits to add up); `tiles` (BLOCK_N, BLOCK_K, warps) overrides `linear.gemv_tiles`."""
    require_triton()
    groups = _check_args(out, cos, sin, weight)
    n, heads, head_dim = out.shape
    if not 1 <= n <= GEMV_MAX_ROWS:
        raise ValueError(f"launch_wo_a_gemv takes 1 to {GEMV_MAX_ROWS} rows, got {n}")
    rank, width = weight.shape[0] // groups, weight.shape[1]
    y = torch.empty((n, groups * rank), dtype=out.dtype, device=out.device)
    block_n, block_k, warps = tiles or gemv_tiles(groups * rank, width, _num_sms(out.device), n)
    grid = (triton.cdiv(rank, block_n), groups)
    pdl = pdl_launch(out.device, math.prod(grid))
    weight = weight.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    _wo_a_gemv_kernel[grid](out.contiguous(), cos, sin, weight, y, n, rank, width, head_dim,
                            head_dim - 2 * cos.shape[1], cos.shape[1], ROWS=triton.next_power_of_2(n), BLOCK_N=block_n,
                            BLOCK_K=block_k, PREFETCH=prefetch_launch(pdl, weight), PDL=pdl, launch_pdl=pdl,
                            num_warps=warps)
    return y


def launch_grouped_wo_a(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                        tiles: Tiles) -> torch.Tensor:
    """`grouped_wo_a` with an explicit launch shape (tests and `bench/decode_sweep.py` vary it)."""
    require_triton()
    groups = _check_args(out, cos, sin, weight)
    n, heads, head_dim = out.shape
    rank, width = weight.shape[0] // groups, weight.shape[1]
    y = torch.empty((n, groups * rank), dtype=out.dtype, device=out.device)
    if n == 0:
        return y
    rd = 2 * cos.shape[1]
    if tiles.splits > 1 and (not _aligned(head_dim, rd) or (heads // groups) % tiles.splits):
        raise ValueError(f"splits={tiles.splits} needs the aligned rotary layout and to divide the "
                         f"{heads // groups} heads of a group")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    precision = "ieee" if out.dtype == torch.float32 else "tf32"  # fp32: a true fp32 GEMM, as torch's
    target = y if tiles.splits == 1 else torch.empty((tiles.splits, n, groups * rank), dtype=torch.float32,
                                                     device=out.device)
    grid = (triton.cdiv(n, tiles.block_m), triton.cdiv(rank, tiles.block_n) * tiles.splits, groups)
    pdl = pdl_launch(out.device, math.prod(grid))
    _wo_a_kernel[grid](out.contiguous(), cos, sin, weight.contiguous(), target, n, rank, width, head_dim,
                       head_dim - rd, cos.shape[1], BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                       BLOCK_K=tiles.block_k, ALIGNED=_aligned(head_dim, rd), PRECISION=precision,
                       SPLITS=tiles.splits, PDL=pdl, launch_pdl=pdl, num_warps=tiles.warps, num_stages=tiles.stages)
    if tiles.splits > 1:
        block = 1024
        programs = triton.cdiv(y.numel(), block)
        pdl = pdl_launch(out.device, programs)
        _sum_splits_kernel[(programs,)](target, y, y.numel(), SPLITS=tiles.splits, BLOCK=block, PDL=pdl,
                                        launch_pdl=pdl, num_warps=4)
    return y
