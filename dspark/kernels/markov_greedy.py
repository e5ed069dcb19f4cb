"""The greedy step of the DSpark drafter's vanilla Markov head: one fused GEMM + add + argmax.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``markov_greedy(base, prev_embed, head_weight) -> tokens``: tokens = argmax over V of
  base.float() + prev_embed · head_weightᵀ, ties to the lowest index (`dspark.sampling.greedy`).
  That is one greedy slot of `sample_chain` / `sample_chain_static` with the vanilla head:
  prev_embed = W1[x_{k−1}] (``head.embed(prev)``), head_weight = W2 (``head.head.weight``).

Shape: base [S, V] any float dtype (rows may be strided: ``base[:, k]`` of an [S, γ, V] block;
the last dim is made contiguous if it is not), prev_embed fp32 [S, r], head_weight fp32 [V, r]
-> LongTensor [S]. Shape symbols: S rows (slots), V vocabulary, r Markov rank.

Why fused: at S = 64, V = 129280, r = 256 the reference is cuBLAS's FP32 FFMA GEMM (≈113 µs per slot
on an H200, compute-bound on the CUDA cores), then an add and an argmax over the [S, V] logits. The
kernel reads W2 once per call (per row block: the row blocks of one V chunk are neighbours in the
grid, so the extra reads hit L2), multiplies on the tensor cores and never writes the logits:

1. `_markov_greedy_kernel`, grid (row blocks of BLOCK_S, V chunks of BLOCK_V): the bias tile
   E[rows] · W2[chunk]ᵀ in BLOCK_R steps of `tl.dot` with fp32 accumulation, + base (masked lanes
   −inf), then the chunk's maximum and the first index holding it -> partial values [S, C] fp32 and
   partial indices [S, C] int64 (C = ceil(V / BLOCK_V) chunks). For few rows (`Tiles.swap`) the
   product is computed transposed, W2[chunk] · E[rows]ᵀ, so that V fills the MMA's M side (64+
   rows per warpgroup on Hopper) and the few rows its N side.
2. torch: the first chunk holding the row maximum (``values.argmax(-1)``), then a gather of that
   chunk's index: two tiny launches. The first maximum of the first chunk holding the row maximum is
   the row's first maximum, so ties go to the lowest index exactly as in torch.argmax.

No host read, no branch on tensor values: CUDA-graph capturable.

Numerics: ``input_precision="tf32x3"`` (default) splits each fp32 operand into a TF32 high part and
a TF32 remainder and sums three tensor-core products (hi·hi + hi·lo + lo·hi): ≈ fp32 accuracy
(relative error ~1e-6 of Σ|e·w|, vs ~1e-3 for one TF32 pass); ``"ieee"`` runs the product as fp32
FMAs on the CUDA cores (what cuBLAS does, in another summation order). Either way the bias differs
from the reference's GEMM by rounding only, so tokens are equal wherever the row's top two logits
are further apart than that (random data: always; the tests require equality). The Triton
interpreter (CPU tests) ignores `input_precision` and multiplies in NumPy fp32: there the option is
only checked to be accepted, its accuracy is measured on the GPU (`tests/kernels/test_markov_greedy.py`,
`bench/markov_greedy.py`).

NaN: as in torch.argmax, NaN counts as the maximum and the first NaN of a row wins (each chunk reports
its first NaN with value NaN; `argmax` over the chunk values then picks the first NaN chunk). A NaN
arises where the inputs hold one (or ±inf products cancel); ±inf logits are ordinary values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from dspark.kernels.registry import require_triton
from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue
from dspark.sampling import greedy

PRECISIONS: tuple[str, ...] = ("tf32x3", "ieee")


def _check_args(base: torch.Tensor, prev_embed: torch.Tensor, head_weight: torch.Tensor) -> None:
    if base.dim() != 2 or not base.is_floating_point() or base.shape[1] == 0:
        raise ValueError(f"base must be a float tensor [S, V] with V >= 1, got {base.dtype} of shape "
                         f"{tuple(base.shape)}")
    n_rows, vocab = base.shape
    if prev_embed.dim() != 2 or prev_embed.dtype != torch.float32 or prev_embed.shape[0] != n_rows:
        raise ValueError(f"prev_embed must be fp32 [S={n_rows}, r], got {prev_embed.dtype} of shape "
                         f"{tuple(prev_embed.shape)}")
    rank = prev_embed.shape[1]
    if head_weight.dim() != 2 or head_weight.dtype != torch.float32 or tuple(head_weight.shape) != (vocab, rank):
        raise ValueError(f"head_weight must be fp32 [V={vocab}, r={rank}], got {head_weight.dtype} of shape "
                         f"{tuple(head_weight.shape)}")
    for name, t in (("prev_embed", prev_embed), ("head_weight", head_weight)):
        if t.device != base.device:
            raise ValueError(f"{name} is on {t.device}, base on {base.device}: all three must share a device")


def markov_greedy_ref(base: torch.Tensor, prev_embed: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """greedy(base.float() + prev_embed · head_weightᵀ): the drafter's code (`sample_chain`, greedy
    slot of the vanilla head) op for op. base [S, V], prev_embed fp32 [S, r], head_weight fp32 [V, r]
    -> LongTensor [S]."""
    _check_args(base, prev_embed, head_weight)
    return greedy(base.float() + F.linear(prev_embed, head_weight))


class Tiles(NamedTuple):
    """Launch shape of `_markov_greedy_kernel`: BLOCK_S rows (>= 16: the MMA's smallest side) x
    BLOCK_V vocabulary entries per program, r in BLOCK_R steps; swap: the transposed product."""

    block_s: int
    block_v: int
    block_r: int
    swap: bool
    num_warps: int
    num_stages: int


# input_precision -> ((S at most, tiles), ...): the first entry whose bound holds; above the last, its
# tiles. "tf32x3" from the H200 sweep (`bench/markov_greedy.py --sweep`, `markov-greedy-h200.json`; V =
# 129280, r = 256, µs per call against the reference's cuBLAS FP32 GEMM + add + argmax):
# * S <= 16: 16 x 64 tiles, E · W2ᵀ, 4 warps, 4 stages: 55.6 / 57.8 µs at 1 / 8 rows (reference 55.5 /
#   91.1): W2 streams at ~52 % of HBM, the reference's GEMV as fast at one row.
# * larger S: 64 rows x 128 vocabulary entries, the swapped product (V on the MMA's M side), 4 warps,
#   3 stages: 105.9 / 192.8 / 359.2 µs at 64 / 128 / 256 rows (reference 164.8 / 306.2 / 594.8). Above
#   64 rows a chunk's W2 tile is read once per row block, the second and later from L2; 128-row blocks
#   at 8 warps were slower (197.2 / 369.8). 17-32 rows take the same tiles (not timed).
# "ieee" (fp32 FMAs, 3-4x slower than "tf32x3" everywhere) keeps the tiles of the first guess (sm_90
# compile: no spill), 128 x 64 above 64 rows where 128 x 128 needed 250 registers.
_TILE_TABLE: dict[str, tuple[tuple[int, Tiles], ...]] = {
    "tf32x3": ((16, Tiles(16, 64, 32, False, 4, 4)), (64, Tiles(64, 128, 32, True, 4, 3))),
    "ieee": ((16, Tiles(16, 128, 32, True, 8, 3)), (32, Tiles(32, 128, 32, True, 8, 3)),
             (64, Tiles(64, 128, 32, True, 8, 3)), (128, Tiles(128, 64, 32, False, 8, 3))),
}


def default_tiles(n_rows: int, rank: int, input_precision: str = "tf32x3") -> Tiles:
    """The tiles `markov_greedy` launches for S = `n_rows` rows, rank `rank` and `input_precision`
    (`_TILE_TABLE`; BLOCK_R is capped at r rounded up to a power of two, at least 16)."""
    table = _TILE_TABLE[input_precision]
    tiles = next((t for bound, t in table if n_rows <= bound), table[-1][1])
    return tiles._replace(block_r=min(tiles.block_r, max(16, triton.next_power_of_2(rank))))


@_jit
def _first_max(logits, index, AXIS: tl.constexpr):
    """(value, index) of the first maximum of `logits` along AXIS, NaN first as in torch.argmax:
    the maximum is taken over the non-NaN values (so the GPU's NaN-dropping max and the
    interpreter's NaN-propagating one agree), then a NaN anywhere overrides it. `index` broadcasts
    against `logits`; the smallest index holding the winner is returned (ties -> lowest index)."""
    nan = logits != logits
    any_nan = tl.max(nan.to(tl.int32), axis=AXIS) > 0
    clean = tl.where(nan, float("-inf"), logits)
    best = tl.max(clean, axis=AXIS)
    wins = tl.where(tl.expand_dims(any_nan, AXIS), nan, clean == tl.expand_dims(best, AXIS))
    first = tl.min(tl.where(wins, index, 2147483647), axis=AXIS)
    return tl.where(any_nan, float("nan"), best), first


@_jit
def _markov_greedy_kernel(base_ptr, e_ptr, w_ptr, val_ptr, idx_ptr, n_rows, vocab, rank, stride_b, stride_e,
                          stride_w, n_chunks, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                          EVEN_R: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (row block, chunk): the first maximum over the chunk's BLOCK_V entries of
    base[rows] + E[rows] · W2[chunk]ᵀ, for BLOCK_S rows -> val/idx [S, n_chunks] at column `chunk`.

    Axis 0 runs over row blocks so that the programs reading one W2 chunk are launched together (the
    second and later read it from L2). SWAP: the tile is held transposed, [BLOCK_V, BLOCK_S] =
    W2[chunk] · E[rows]ᵀ (V on the MMA's M side when the rows are few), and reduced along axis 0."""
    pdl_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask, col_mask = rows < n_rows, cols < vocab
    ks = tl.arange(0, BLOCK_R)
    e_rows = e_ptr + rows.to(tl.int64)[:, None] * stride_e  # [BLOCK_S, 1]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w  # [BLOCK_V, 1]
    if SWAP:
        acc = tl.zeros((BLOCK_V, BLOCK_S), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_S, BLOCK_V), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        # Masked rows / columns / ranks load 0: they add nothing to any kept product.
        if EVEN_R:
            e_mask, w_mask = row_mask[:, None], col_mask[:, None]
        else:
            k_mask = (r0 + ks < rank)[None, :]
            e_mask, w_mask = row_mask[:, None] & k_mask, col_mask[:, None] & k_mask
        e = tl.load(e_rows + r0 + ks[None, :], mask=e_mask, other=0.0)  # [BLOCK_S, BLOCK_R]
        w = tl.load(w_rows + r0 + ks[None, :], mask=w_mask, other=0.0)  # [BLOCK_V, BLOCK_R]
        if SWAP:
            acc = tl.dot(w, tl.trans(e), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(e, tl.trans(w), acc, input_precision=PRECISION)
    rows64 = rows.to(tl.int64)
    if SWAP:
        mask = col_mask[:, None] & row_mask[None, :]
        base = tl.load(base_ptr + rows64[None, :] * stride_b + cols[:, None], mask=mask, other=0.0)
        # Columns past V are −inf: never a maximum unless the whole row is −inf, and then the
        # chunk's first real column (lower) wins anyway; masked rows are not stored.
        logits = tl.where(col_mask[:, None], base.to(tl.float32) + acc, float("-inf"))
        val, idx = _first_max(logits, cols[:, None], 0)
    else:
        mask = row_mask[:, None] & col_mask[None, :]
        base = tl.load(base_ptr + rows64[:, None] * stride_b + cols[None, :], mask=mask, other=0.0)
        logits = tl.where(col_mask[None, :], base.to(tl.float32) + acc, float("-inf"))
        val, idx = _first_max(logits, cols[None, :], 1)
    out = rows64 * n_chunks + chunk
    tl.store(val_ptr + out, val, mask=row_mask)
    tl.store(idx_ptr + out, idx.to(tl.int64), mask=row_mask)


def markov_greedy(base: torch.Tensor, prev_embed: torch.Tensor, head_weight: torch.Tensor, *,
                  input_precision: str = "tf32x3", tiles: Tiles | None = None) -> torch.Tensor:
    """Fused `markov_greedy_ref` (same signature and result): tokens LongTensor [S].

    input_precision : the bias product's `tl.dot` precision, "tf32x3" (default, ≈ fp32 on tensor
        cores) or "ieee" (fp32 FMAs); see the module docstring.
    tiles : launch shape (`Tiles`), default `default_tiles(S, r, input_precision)`; for benchmarks.
    """
    _check_args(base, prev_embed, head_weight)
    if input_precision not in PRECISIONS:
        raise ValueError(f"input_precision must be one of {PRECISIONS}, got {input_precision!r}")
    require_triton()
    n_rows, vocab = base.shape
    rank = prev_embed.shape[1]
    tiles = default_tiles(n_rows, rank, input_precision) if tiles is None else tiles
    if tiles.block_s < 16 or tiles.block_r < 16 or tiles.block_v < 16:
        raise ValueError(f"tiles: BLOCK_S, BLOCK_V and BLOCK_R must be >= 16 (tl.dot), got {tiles}")
    if n_rows == 0:
        return torch.empty(0, dtype=torch.long, device=base.device)
    # Unit inner strides (the kernel indexes columns directly); views with strided rows are fine.
    base = base if base.stride(1) == 1 else base.contiguous()
    prev_embed = prev_embed if prev_embed.stride(1) == 1 or rank == 1 else prev_embed.contiguous()
    head_weight = head_weight if head_weight.stride(1) == 1 or rank == 1 else head_weight.contiguous()
    n_chunks = triton.cdiv(vocab, tiles.block_v)
    values = torch.empty(n_rows, n_chunks, dtype=torch.float32, device=base.device)
    index = torch.empty(n_rows, n_chunks, dtype=torch.long, device=base.device)
    grid = (triton.cdiv(n_rows, tiles.block_s), n_chunks)
    pdl = pdl_launch(base.device, grid[0] * grid[1])
    _markov_greedy_kernel[grid](
        base, prev_embed, head_weight, values, index, n_rows, vocab, rank, base.stride(0), prev_embed.stride(0),
        head_weight.stride(0), n_chunks, BLOCK_S=tiles.block_s, BLOCK_V=tiles.block_v, BLOCK_R=tiles.block_r,
        EVEN_R=rank % tiles.block_r == 0, SWAP=tiles.swap, PRECISION=input_precision, PDL=pdl, launch_pdl=pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    # The first chunk holding the row maximum (NaN first, ties low: torch.argmax), then its first index.
    return index.gather(1, values.argmax(1, keepdim=True)).squeeze(1)
