"""`_wide_kernel`: the decode / verify-sized variant of `sparse_attention`'s flash-decoding pass.

`attention.launch_sparse_attention` runs it for `Tiles(wide=True, ...)`; the op, its reference and
the chunk merge (`_combine_kernel`) live in `attention.py`.

Against `attention._partial_kernel` it changes three things, each a launch-shape choice:

* heads: `BLOCK_H` may cover every head of a query (32 or 64 at head_dim 512), so each key row is
  gathered once per query, not once per head block; from 64 rows on the dots are Hopper `wgmma`;
* value split: the fp32 accumulator [heads, d] of 64 heads × 512 is 128 KB, all of an SM's registers
  at 8 warps. With `V_SPLIT` = 2 program v keeps only the value columns [v·d/2, (v+1)·d/2): it still
  scores its keys over all of d (the key tile is gathered as two column halves, its own half last),
  and accumulates P·V on its own half. The two programs of a query run back to back, so the second
  gathers the rows from L2; the price is the score dot done twice;
* direct output: with one key chunk (`FINAL`, large S) the program applies the sink, normalises and
  stores `out` in q's dtype; the fp32 partials' write and read and the merge launch go away. With
  several chunks it writes the same partials as `_partial_kernel` for `_combine_kernel`.

Programs are numbered (query s, chunk c, head block hb, value half v), v fastest, so that the
programs that gather the same key rows are scheduled together.

Shape symbols: S query rows, H heads, d head_dim, K keys per query, C key chunks.
"""

from __future__ import annotations

import math

import torch

from dspark.kernels.triton_compat import jit as _jit, tl
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue


@_jit
def _wide_kernel(
    q_ptr, pool_ptr, idx_ptr, sink_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
    n_q, n_heads, head_dim, n_keys, keys_per_chunk, scale, n_hblocks, n_chunks,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, V_SPLIT: tl.constexpr,
    FINAL: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr,
):
    """Online softmax of query s, heads of block hb, over keys [c·keys_per_chunk, (c+1)·...), value
    columns [v·BLOCK_V, (v+1)·BLOCK_V): with FINAL out [S, H, d] (sink applied, q's dtype), else
    m, l [C, S, H] and acc [C, S, H, d] (fp32, un-normalised) for `_combine_kernel`.

    V_SPLIT is 1 (BLOCK_V >= d: one program holds every value column) or 2."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    v = pid % V_SPLIT
    rest = pid // V_SPLIT
    hb = rest % n_hblocks
    rest = rest // n_hblocks
    c = rest % n_chunks
    s = (rest // n_chunks).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < n_heads
    own = v * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's value columns
    other = (1 - v) * BLOCK_V + tl.arange(0, BLOCK_V)  # V_SPLIT = 2: the other half, scored only
    q_rows = (s * n_heads + offs_h)[:, None] * head_dim
    q_own = tl.load(q_ptr + q_rows + own[None, :], mask=h_mask[:, None] & (own < head_dim)[None, :], other=0.0)
    if V_SPLIT == 2:
        q_other = tl.load(q_ptr + q_rows + other[None, :], mask=h_mask[:, None] & (other < head_dim)[None, :],
                          other=0.0)
    m = tl.full((BLOCK_H,), -1.0e30, dtype=tl.float32)  # finite: no inf − inf
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
    start = c * keys_per_chunk
    end = tl.minimum(start + keys_per_chunk, n_keys)
    rows = _index_tile(idx_ptr, s * n_keys, start, end, BLOCK_N)
    for n0 in range(0, keys_per_chunk, BLOCK_N):  # fixed trip count: the interpreter needs it
        # The index tile of the next step is loaded one step ahead into registers, so the row
        # gathers' addresses come from the loop's carried state: Triton's pipeliner then issues the
        # gathers num_stages − 1 tiles ahead as asynchronous copies. (Indexed by a tile loaded in the
        # same step, the gather went only one tile ahead and its wait came right before the math.)
        cur, valid = rows, rows >= 0
        rows = _index_tile(idx_ptr, s * n_keys, start + n0 + BLOCK_N, end, BLOCK_N)
        if V_SPLIT == 2:
            k_other = _gather(pool_ptr, cur, valid, head_dim, other)
            scores = _dot(q_other, tl.trans(k_other), None, DOT_FP32)
            k_own = _gather(pool_ptr, cur, valid, head_dim, own)
            scores = _dot(q_own, tl.trans(k_own), scores, DOT_FP32)
        else:
            k_own = _gather(pool_ptr, cur, valid, head_dim, own)
            scores = _dot(q_own, tl.trans(k_own), None, DOT_FP32)
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))  # [BH, BN]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        if DOT_FP32:
            acc = _dot(p, k_own, acc * alpha[:, None], DOT_FP32)
        else:
            p = p.to(k_own.dtype)  # l sums the rounded P that weighs the values (see _partial_kernel)
            acc = tl.dot(p, k_own, acc * alpha[:, None])
            p = p.to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    hd_mask = h_mask[:, None] & (own < head_dim)[None, :]
    if FINAL:
        # out = acc / (l + e^{sink − m}), rescaled to max(m, sink) so that neither exponent overflows
        # (a query with no key keeps m = −1e30: weight 0, out = 0, all mass on the sink).
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        top = tl.maximum(m, sink)
        w = tl.exp(m - top)
        out = acc * (w / (l * w + tl.exp(sink - top)))[:, None]
        tl.store(out_ptr + q_rows + own[None, :], out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        part = (c * n_q + s) * n_heads + offs_h  # [BH]; both value halves store the same m, l
        tl.store(m_ptr + part, m, mask=h_mask)
        tl.store(l_ptr + part, l, mask=h_mask)
        tl.store(acc_ptr + part[:, None] * head_dim + own[None, :], acc, mask=hd_mask)


@_jit
def _index_tile(idx_ptr, row_base, first, end, BLOCK_N: tl.constexpr):
    """Pool rows of keys first .. first+BLOCK_N−1 (< end) of the index row at `row_base` [BN] (−1 past end)."""
    offs_n = first + tl.arange(0, BLOCK_N)
    return tl.load(idx_ptr + row_base + offs_n, mask=offs_n < end, other=-1).to(tl.int64)


@_jit
def _gather(pool_ptr, rows, valid, head_dim, cols):
    """pool[rows, cols] [BN, BV] (0 where the key is −1 or the column is past d)."""
    mask = valid[:, None] & (cols < head_dim)[None, :]
    return tl.load(pool_ptr + rows[:, None] * head_dim + cols[None, :], mask=mask, other=0.0)


@_jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    """a @ b (+ acc) in fp32: bf16 operands on the tensor cores, fp32 ones as 3-pass TF32."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")
    return tl.dot(a, b, acc)


def launch_wide(q, pool, index, sink, out, partials, scale, tiles, n_hblocks, n_chunks, keys_per_chunk, d_pad):
    """`_wide_kernel` over (query, chunk, head block, value half) with the launch shape `tiles`
    (`attention.Tiles`): out [S, H, d] directly when n_chunks is 1, else the partials (m, l, acc) that
    `attention._combine_kernel` merges. q, pool, index contiguous, sink fp32."""
    n_q, n_heads, head_dim = q.shape
    split = tiles.value_split
    grid = (n_q * n_chunks * n_hblocks * split,)
    pdl = pdl_launch(q.device, math.prod(grid))
    _wide_kernel[grid](
        q, pool, index, sink, out, *partials,
        n_q, n_heads, head_dim, index.shape[1], keys_per_chunk, float(scale), n_hblocks, n_chunks,
        BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n, BLOCK_V=max(16, d_pad // split), V_SPLIT=split,
        FINAL=n_chunks == 1, DOT_FP32=q.dtype == torch.float32 or pool.dtype == torch.float32, PDL=pdl,
        launch_pdl=pdl, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
