"""Lightning indexer (deepseek_v4 spec §8.4, deepseek_v41 spec §5.3-§5.4): scores and top-k.

Ops (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``lightning_indexer(q, weights, keys, visible, candidates, *, topk) -> (ids, scores)``:
  I[s, t] = Σ_h weights[s, h] · ReLU(q[s, h] · keys[t]) over the entries t < visible[s] (and,
  for V4.1 candidate consumers, inside the candidate pool), then the top-k entries per row,
  ascending by id, −1 padded. Ties: higher score first, then lower entry id (`indexer_ref.py`).
* ``index_scores(q, weights, keys, visible) -> scores``: the scores alone for B groups of rows, each
  against its own keys ([B, S, Hi, di], [B, S, Hi], [B, T, di], [B, S] -> [B, S, T], −inf where
  t ≥ visible): the static decode steps score every slot in one launch of `_score_kernel` (grid
  axis 2 = group) instead of fp32 copies of every slot's keys and a [B, S, Hi, T] fp32 product.
* ``select_topk(scores, topk) -> ids``: the selection alone, for scores computed elsewhere (the
  static decode steps score every slot's entries in one batched pass): `_select_kernel` below, one
  program per row, instead of the reference's two full sorts.

Shape symbols: S query rows, Hi index heads, di index head dim, T compressed entries, k = topk.

Fused kernels, two launches:

1. `_score_kernel`, grid (T tiles, S blocks): each program loads one tile of keys once and scores
   it against every row of its block (one [Hi, di] × [di, BLOCK_T] tensor-core dot per row, ReLU,
   head weights, Σ over heads in fp32), applying the visibility and candidate masks as −inf before
   it writes [S, T] fp32 scores (the masked entries can therefore never be selected). With POOL_B
   (`indexer_pool.index_scores_pooled`, via `launch_index_scores`) its epilogue also writes the V4.1
   candidate pool's block maxima of each tile's whole blocks, so the pool does not re-read the scores.
2. `_select_kernel`, one program per row: a radix search over the scores' order-preserving int32
   keys finds the k-th largest score θ in 8 counting passes of 4 bits (16 counts each; the row in
   two register tiles, a power of two and the rest rounded up, for T ≤ 8192 + 1024 (`register_tiles`),
   else passes over L2-resident tiles); one more pass writes
   the entries > θ and the first (k − #(> θ)) entries equal to θ, in id order, via prefix sums --
   so ids come out ascending and the tie rule is exactly the reference's.

No host sync, buffers sized from shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import math

import torch

from dspark.kernels.indexer_ref import _check_args, _check_index_scores_args, check_select_args  # the refs below: the ops' refs
from dspark.kernels.indexer_ref import index_scores_ref, lightning_indexer_ref, select_topk_ref  # noqa: F401
from dspark.kernels.registry import require_triton

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue


_REGISTER_ROW = 8192  # rows up to this many entries stay in registers during selection
_STREAM_TILE = 4096  # tile of the passes over longer rows
_REGISTER_TAIL = 1024  # past _REGISTER_ROW, a row's rest up to this many entries stays in registers too
# Bits of θ per counting pass of the selection (`_kth_largest`): 8 passes instead of 32. On one H200 the
# v4-mini batch-1 step's _select_kernel (one row of 1024 entries) took 9.5 µs with 32 (graph profile s9).
RADIX_BITS = 4


# --------------------------------------------------------------------------------- Triton kernels


@_jit
def _score_kernel(
    q_ptr, w_ptr, k_ptr, vis_ptr, cand_ptr, out_ptr, bmax_ptr,
    n_q, n_heads, head_dim, n_keys, n_blocks, k_group_stride,
    HAS_CAND: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    D_PAD: tl.constexpr, DOT_FP32: tl.constexpr, FP32_CHUNK: tl.constexpr, POOL_B: tl.constexpr, PDL: tl.constexpr,
):
    """scores[s, t] for the rows s of block program_id(1) and entries t of tile program_id(0), of
    group program_id(2) (`index_scores`: every tensor holds B groups back to back; one group otherwise).
    POOL_B > 0 (a power of two dividing BLOCK_T; `index_scores_pooled`): also the tile's block maxima
    bmax[s, b] over POOL_B consecutive masked scores, the newest visible entry's block pinned to +inf
    (`indexer_pool._block_max_kernel`'s rule), so the pool need not re-read the scores."""
    pdl_prologue(PDL)
    b = tl.program_id(2).to(tl.int64)
    q_ptr += b * n_q * n_heads * head_dim
    w_ptr += b * n_q * n_heads
    k_ptr += b * k_group_stride  # a slot's keys may be a prefix of a longer row block (static state)
    vis_ptr += b * n_q
    out_ptr += b * n_q * n_keys
    bmax_ptr += b * n_q * n_blocks
    if HAS_CAND:
        cand_ptr += b * n_q * n_keys
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    s0 = tl.program_id(1).to(tl.int64) * BLOCK_S
    t_mask = offs_t < n_keys
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_PAD)
    h_mask = offs_h < n_heads
    d_mask = offs_d < head_dim
    k_rows = k_ptr + offs_t.to(tl.int64)[:, None] * head_dim
    if not DOT_FP32:
        keys = tl.load(k_rows + offs_d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0)  # [BT, D], once
    for i in range(BLOCK_S):
        s = s0 + i
        row_ok = s < n_q
        q_rows = q_ptr + (s * n_heads + offs_h)[:, None] * head_dim
        w = tl.load(w_ptr + s * n_heads + offs_h, mask=row_ok & h_mask, other=0.0).to(tl.float32)
        if DOT_FP32:
            # fp32 operands FP32_CHUNK dims at a time: whole-D fp32 tiles, which tf32x3 splits into
            # three, overflow shared memory at wide heads (262 KB at 32 heads x 512 on sm_90)
            dots = tl.zeros((BLOCK_H, BLOCK_T), tl.float32)
            for d0 in range(0, D_PAD, FP32_CHUNK):
                offs_c = d0 + tl.arange(0, FP32_CHUNK)
                c_mask = offs_c < head_dim
                kc = tl.load(k_rows + offs_c[None, :], mask=t_mask[:, None] & c_mask[None, :], other=0.0)
                qc = tl.load(q_rows + offs_c[None, :], mask=row_ok & h_mask[:, None] & c_mask[None, :], other=0.0)
                dots += tl.dot(qc.to(tl.float32), tl.trans(kc.to(tl.float32)), input_precision="tf32x3")
        else:
            q = tl.load(q_rows + offs_d[None, :], mask=row_ok & h_mask[:, None] & d_mask[None, :], other=0.0)  # [BH, D]
            dots = tl.dot(q, tl.trans(keys))  # [BH, BT] fp32 accumulation
        score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)  # padded heads: w = 0
        vis = tl.load(vis_ptr + s, mask=row_ok, other=0)
        reachable = offs_t < vis
        if HAS_CAND:
            reachable &= tl.load(cand_ptr + s * n_keys + offs_t, mask=row_ok & t_mask, other=0) != 0
        score = tl.where(reachable, score, float("-inf"))
        tl.store(out_ptr + s * n_keys + offs_t, score, mask=row_ok & t_mask)
        if POOL_B > 0:  # the tile holds BLOCK_T / POOL_B whole blocks; entries past T pad with −inf
            blocks = tl.reshape(tl.where(t_mask, score, float("-inf")), (BLOCK_T // POOL_B, POOL_B))
            offs_b = tl.program_id(0) * (BLOCK_T // POOL_B) + tl.arange(0, BLOCK_T // POOL_B)
            newest = tl.where(vis > 0, (vis - 1) // POOL_B, -1)  # Triton's // truncates: (0 − 1) // b would be 0
            best = tl.where(offs_b == newest, float("inf"), tl.max(blocks, axis=1))
            tl.store(bmax_ptr + s * n_blocks + offs_b, best, mask=row_ok & (offs_b < n_blocks))


@_jit
def _order_keys(scores):
    """fp32 -> int32 with the same order (−0 folded onto +0 so that they tie, as floats do)."""
    scores = tl.where(scores == 0.0, 0.0, scores)
    bits = scores.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@_jit
def _count_at_least(row_ptr, n_keys, keys, tail, threshold, ONE_TILE: tl.constexpr, BLOCK_T: tl.constexpr,
                    TAIL: tl.constexpr):
    """How many entries of the row have an order key >= threshold (int32 scalar)."""
    if ONE_TILE:
        total = tl.sum((keys >= threshold).to(tl.int32), axis=0)
        if TAIL > 0:
            total += tl.sum((tail >= threshold).to(tl.int32), axis=0)
    else:
        total = tl.full((), 0, tl.int32)
        for t0 in range(0, n_keys, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            tile = _order_keys(tl.load(row_ptr + offs, mask=offs < n_keys, other=float("-inf")))
            total += tl.sum(((tile >= threshold) & (offs < n_keys)).to(tl.int32), axis=0)
    return total


@_jit
def _digit_counts(keys, in_row, lo, SHIFT: tl.constexpr, RADIX: tl.constexpr):
    """Histogram [RADIX] int32 of the keys >= lo by their digit (key − lo) >> SHIFT, keys past the
    last digit counted in it (a histogram, not RADIX comparisons per key: few registers)."""
    rel = keys.to(tl.int64) - lo
    digit = tl.minimum(rel >> SHIFT, RADIX - 1).to(tl.int32)
    return tl.histogram(digit, RADIX, mask=(rel >= 0) & in_row)


@_jit
def _count_each(row_ptr, n_keys, keys, tail, lo, SHIFT: tl.constexpr, RADIX: tl.constexpr, ONE_TILE: tl.constexpr,
                BLOCK_T: tl.constexpr, TAIL: tl.constexpr):
    """#(key >= lo + d·2^SHIFT) for d = 0 .. RADIX−1 ([RADIX] int32) in one pass over the row."""
    if ONE_TILE:
        hist = _digit_counts(keys, keys == keys, lo, SHIFT, RADIX)
        if TAIL > 0:
            hist += _digit_counts(tail, tail == tail, lo, SHIFT, RADIX)
    else:
        hist = tl.zeros((RADIX,), tl.int32)
        for t0 in range(0, n_keys, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            tile = _order_keys(tl.load(row_ptr + offs, mask=offs < n_keys, other=float("-inf")))
            hist += _digit_counts(tile, offs < n_keys, lo, SHIFT, RADIX)
    return tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # the counts of digits >= d


@_jit
def _kth_largest(row_ptr, n_keys, keys, tail, topk, ONE_TILE: tl.constexpr, BLOCK_T: tl.constexpr,
                 TAIL: tl.constexpr, RADIX_BITS: tl.constexpr):
    """Threshold of a row's top-k: (θ, n_take, n_ties) -- θ the order key of the k-th largest
    finite score, n_take = min(k, #finite) entries to take, n_ties of them equal to θ (the rest > θ).

    θ is the largest int32 t with #(key >= t) >= n_take, found digit by digit from the top: each of
    32 / RADIX_BITS passes counts the row against the 2^RADIX_BITS candidates lo + d·2^shift at once
    (a histogram of the digits) and keeps the largest d whose count still reaches n_take (d = 0
    always does: #(key >= lo) >= n_take holds from lo = −2^31 on). RADIX_BITS 1 is a bisection in the
    former kernel's 32 passes; 4 takes 8 passes: the passes are serial reductions, so at one row
    (batch-1 decode) their number sets the kernel's latency. With ONE_TILE the row is in registers:
    `keys` its first BLOCK_T entries and, with TAIL > 0, `tail` the next TAIL (`register_tiles`);
    padding is −inf, below every finite key, so it never moves θ."""
    # Finite entries: order key above _order_keys(−inf) = 0xFF800000 ^ 0x7FFFFFFF = −2139095041.
    n_take = tl.minimum(_count_at_least(row_ptr, n_keys, keys, tail, -2139095040, ONE_TILE, BLOCK_T, TAIL), topk)
    lo = tl.full((), -2147483648, tl.int64)  # int64: lo + d·2^shift never wraps
    for p in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (p + 1)  # a constant: p is unrolled
        counts = _count_each(row_ptr, n_keys, keys, tail, lo, shift, 1 << RADIX_BITS, ONE_TILE, BLOCK_T, TAIL)
        lo += (tl.sum((counts >= n_take).to(tl.int64), axis=0) - 1) << shift  # counts fall with d
    theta = lo.to(tl.int32)
    n_above = tl.where(n_take > 0, _count_at_least(row_ptr, n_keys, keys, tail, theta + 1, ONE_TILE, BLOCK_T, TAIL),
                       0)
    return theta, n_take, n_take - n_above


@_jit
def _take_flags(tile, in_row, theta, n_ties, ties_seen):
    """Which entries of one id-ordered tile of order keys are in the top-k: all > θ and the first
    `n_ties` equal to θ of the row (`ties_seen` of them in earlier tiles). Returns (take int32
    [BLOCK_T], ties_seen after this tile)."""
    tie = ((tile == theta) & in_row).to(tl.int32)
    tie_rank = ties_seen + tl.cumsum(tie, axis=0) - 1
    take = (((tile > theta) & in_row) | ((tie != 0) & (tie_rank < n_ties))).to(tl.int32)
    return take, ties_seen + tl.sum(tie, axis=0)


@_jit
def _write_picks(out_row, ids, tile, in_row, theta, n_ties, ties_seen, written, base):
    """Store one id-ordered tile's picks at the next free slots of the output row (+ base).
    Returns (ties_seen, written) after the tile."""
    take, ties_seen = _take_flags(tile, in_row, theta, n_ties, ties_seen)
    slot = written + tl.cumsum(take, axis=0) - 1
    tl.store(out_row + slot, ids.to(tl.int64) + base, mask=take != 0)
    return ties_seen, written + tl.sum(take, axis=0)


@_jit
def _select_kernel(score_ptr, out_ptr, offset_ptr, n_keys, topk, n_out, out_stride, ONE_TILE: tl.constexpr,
                   BLOCK_T: tl.constexpr, TAIL: tl.constexpr, HAS_OFFSET: tl.constexpr, RADIX_BITS: tl.constexpr,
                   PDL: tl.constexpr):
    """ids[s, :n_out] of row s = program_id(0): the top-k (ties: lower id) ascending, + offset[s]
    with HAS_OFFSET, −1 padded; row s of the output starts at out_ptr + s·out_stride. ONE_TILE:
    the row's first BLOCK_T entries and (TAIL > 0) its next TAIL stay in registers throughout."""
    pdl_prologue(PDL)
    s = tl.program_id(0).to(tl.int64)
    base = tl.load(offset_ptr + s) if HAS_OFFSET else 0
    row_ptr = score_ptr + s * n_keys
    offs = tl.arange(0, BLOCK_T)
    offs_tail = BLOCK_T + tl.arange(0, TAIL if TAIL > 0 else 16)
    keys = offs  # bound on both paths for the compiler; only the one-tile path reads them
    tail = offs_tail
    if ONE_TILE:
        keys = _order_keys(tl.load(row_ptr + offs, mask=offs < n_keys, other=float("-inf")))
        if TAIL > 0:
            tail = _order_keys(tl.load(row_ptr + offs_tail, mask=offs_tail < n_keys, other=float("-inf")))
    theta, n_take, n_ties = _kth_largest(row_ptr, n_keys, keys, tail, topk, ONE_TILE, BLOCK_T, TAIL, RADIX_BITS)
    out_row = out_ptr + s * out_stride
    written = tl.full((), 0, tl.int32)
    ties_seen = tl.full((), 0, tl.int32)
    if ONE_TILE:
        ties_seen, written = _write_picks(out_row, offs, keys, offs < n_keys, theta, n_ties, ties_seen, written, base)
        if TAIL > 0:
            ties_seen, written = _write_picks(out_row, offs_tail, tail, offs_tail < n_keys, theta, n_ties, ties_seen,
                                              written, base)
    else:
        for t0 in range(0, n_keys, BLOCK_T):
            ids = t0 + offs
            in_row = ids < n_keys
            tile = _order_keys(tl.load(row_ptr + ids, mask=in_row, other=float("-inf")))
            ties_seen, written = _write_picks(out_row, ids, tile, in_row, theta, n_ties, ties_seen, written, base)
    for o0 in range(0, n_out, BLOCK_T):
        slot = o0 + offs
        tl.store(out_row + slot, tl.full((BLOCK_T,), -1, tl.int64), mask=(slot >= n_take) & (slot < n_out))


# ------------------------------------------------------------------------------------- launcher


def _score_tiles(n_q: int, n_heads: int, head_dim: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_S, BLOCK_H, BLOCK_T, D_PAD, num_warps); tl.dot needs >= 16 on every side."""
    block_h = max(16, triton.next_power_of_2(n_heads))
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_t = 64 if block_h * d_pad <= 64 * 128 else 32  # the [BH, BT] fp32 dot stays in registers
    return min(8, triton.next_power_of_2(n_q)), block_h, block_t, d_pad, 4


def lightning_indexer(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                      candidates: torch.Tensor | None, *, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused `lightning_indexer_ref` (same signature, shapes, dtypes and tie rule)."""
    require_triton()
    _check_args(q, weights, keys, visible, candidates, topk)
    n_q, n_heads, head_dim = q.shape
    n_keys = keys.shape[0]
    scores = torch.empty((n_q, n_keys), dtype=torch.float32, device=q.device)
    if n_q == 0 or n_keys == 0:
        return torch.empty((n_q, min(topk, n_keys)), dtype=torch.int64, device=q.device), scores
    block_s, block_h, block_t, d_pad, warps = _score_tiles(n_q, n_heads, head_dim)
    cand = candidates.view(torch.uint8) if candidates is not None else visible  # dummy pointer when absent
    grid = (triton.cdiv(n_keys, block_t), triton.cdiv(n_q, block_s))
    pdl = pdl_launch(q.device, math.prod(grid))
    _score_kernel[grid](
        q.contiguous(), weights.float().contiguous(), keys.contiguous(), visible.contiguous(), cand.contiguous(),
        scores, scores, n_q, n_heads, head_dim, n_keys, 0, 0,
        HAS_CAND=candidates is not None, BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_T=block_t, D_PAD=d_pad,
        DOT_FP32=q.dtype == torch.float32 or keys.dtype == torch.float32, FP32_CHUNK=min(d_pad, 32), POOL_B=0,
        PDL=pdl, launch_pdl=pdl,
        num_warps=warps,
    )
    return select_topk(scores, topk), scores


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Fused `index_scores_ref` (same signature, shapes and dtypes): one `_score_kernel` launch."""
    require_triton()
    _check_index_scores_args(q, weights, keys, visible)
    scores = torch.empty(q.shape[:2] + keys.shape[1:2], dtype=torch.float32, device=q.device)
    launch_index_scores(q, weights, keys, visible, scores)
    return scores


def pool_block_fits(block: int, n_heads: int, head_dim: int) -> bool:
    """Whether `_score_kernel`'s key tiles hold whole pool blocks of `block` entries (a power of two
    up to BLOCK_T), so that its epilogue can write their maxima (`launch_index_scores`' block_max)."""
    block_t = _score_tiles(1, n_heads, head_dim)[2]  # BLOCK_T does not depend on the row count
    return block & (block - 1) == 0 and block <= block_t


def launch_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                        scores: torch.Tensor, block_max: torch.Tensor | None = None, block: int = 0) -> None:
    """One `_score_kernel` launch over B groups (arguments checked by the caller): writes scores
    [B, S, T] fp32 and, with `block_max` [B, S, ceil(T / block)] fp32 (`pool_block_fits(block, ...)`),
    the pool's block maxima with the newest block pinned (`indexer_pool.index_scores_pooled`)."""
    n_groups, n_q, n_heads, head_dim = q.shape
    n_keys = keys.shape[1]
    if scores.numel() == 0:
        return
    block_s, block_h, block_t, d_pad, warps = _score_tiles(n_q, n_heads, head_dim)
    visible = visible.contiguous()
    if keys.stride(2) != 1 or keys.stride(1) != head_dim:  # rows must be dense; groups may be spaced
        keys = keys.contiguous()
    grid = (triton.cdiv(n_keys, block_t), triton.cdiv(n_q, block_s), n_groups)
    pdl = pdl_launch(q.device, math.prod(grid))
    _score_kernel[grid](
        q.contiguous(), weights.float().contiguous(), keys, visible, visible, scores,
        scores if block_max is None else block_max,  # a dummy pointer when absent
        n_q, n_heads, head_dim, n_keys, 0 if block_max is None else block_max.shape[-1], keys.stride(0),
        HAS_CAND=False, BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_T=block_t, D_PAD=d_pad,
        DOT_FP32=q.dtype == torch.float32 or keys.dtype == torch.float32, FP32_CHUNK=min(d_pad, 32),
        POOL_B=0 if block_max is None else block,
        PDL=pdl, launch_pdl=pdl, num_warps=warps,
    )


def select_topk(scores: torch.Tensor, topk: int, *, offset: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused `select_topk_ref` (same signature and tie rule): scores [S, T] fp32 (−inf = unreachable)
    -> [S, min(k, T)] int64 ids of the best reachable entries, ascending by id, −1 padded; `offset`
    added to the ids and `out` written in the kernel's stores (no launches after it)."""
    return launch_select_topk(scores, topk, offset, out, RADIX_BITS)


def register_tiles(n_keys: int) -> tuple[int, int] | None:
    """(BLOCK_T, TAIL): the two power-of-two register tiles of `_select_kernel` for a row of n_keys
    entries -- the largest power of two that fits and the rest rounded up -- or None when the row
    streams through L2 in `_STREAM_TILE` tiles (more than `_REGISTER_ROW` entries plus a short tail).
    A static bucket holds its capacity's entries (the context plus headroom: 1 040 at 4K for ratio 4,
    4 160 for V4.1's ratio 1): one tile rounded up would be twice the row, and every counting pass
    costs in proportion to the tiles' size."""
    block = max(16, 1 << (max(n_keys, 1).bit_length() - 1))
    if block > _REGISTER_ROW:
        block = _REGISTER_ROW
    rest = n_keys - block
    if rest <= 0:
        return block, 0
    tail = max(16, triton.next_power_of_2(rest))
    if block == _REGISTER_ROW and tail > _REGISTER_TAIL:
        return None
    return block, tail


def select_warps(block: int) -> int:
    """Warps of a `_select_kernel` program over register tiles of `block` entries in all: its
    counting passes are serial block reductions, and more warps hide their latency up to a point
    (one H100, top-512, `select-round-sweep-h100-s27.json` and `select-tail-sweep-h100-s27.json`:
    1 024 entries 6.4 -> 5.9 µs at 8 warps instead of 4; 4 096 + 64 best at 8, 14.8 µs; 8 192
    entries 32 -> 24 µs at 16 instead of 8, 30 at 32)."""
    return 16 if block >= 8192 else 8 if block >= 1024 else 4


def launch_select_topk(scores: torch.Tensor, topk: int, offset: torch.Tensor | None, out: torch.Tensor | None,
                       radix_bits: int, num_warps: int | None = None) -> torch.Tensor:
    """`select_topk` with θ found `radix_bits` bits per pass (1, 2, 4 or 8; the bench times 1, the
    former 32-pass search, against `RADIX_BITS`) by programs of `num_warps` warps (default
    `select_warps`; `bench/select_round_sweep.py` times the others)."""
    require_triton()
    check_select_args(scores, topk, offset, out)
    if radix_bits not in (1, 2, 4, 8):
        raise ValueError(f"radix_bits must be 1, 2, 4 or 8, got {radix_bits!r}")
    n_q, n_keys = scores.shape
    n_out = min(topk, n_keys)
    ids = out if out is not None else torch.empty((n_q, n_out), dtype=torch.int64, device=scores.device)
    if n_q == 0 or n_keys == 0:
        return ids
    tiles = register_tiles(n_keys)
    block, tail = tiles if tiles is not None else (_STREAM_TILE, 0)
    pdl = pdl_launch(scores.device, n_q)
    offsets = offset.reshape(-1).contiguous() if offset is not None else ids  # a dummy pointer when absent
    _select_kernel[(n_q,)](scores.contiguous(), ids, offsets, n_keys, n_out, n_out, ids.stride(0),
                           ONE_TILE=tiles is not None, BLOCK_T=block, TAIL=tail, HAS_OFFSET=offset is not None,
                           RADIX_BITS=radix_bits, PDL=pdl, launch_pdl=pdl,
                           num_warps=num_warps or select_warps(block + tail))
    return ids
