"""Sparse MQA with an attention sink (deepseek_v4 spec §7.4): window, CSA and HCA attention in one op.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``sparse_attention(q, pool, index, sink, scale) -> out``: query s attends to the rows
  ``pool[index[s, j]]`` (−1 = no key), each row both key and value (shared-KV MQA), with a per-head
  sink logit that joins the softmax denominator only.
* ``sparse_attention_qnorm(q, cos, sin, pool, index, sink, scale, *, eps) -> out``: the same attention of
  V4's raw q heads (wq_b's output), each head first RMS-normalised (unweighted) and rotated (cos / sin
  [S, rd/2]) as ``norm_rope`` does. With Q_NORM_FOLD (a candidate, off) `_partial_kernel` normalises and
  rotates the q tile it loads (one launch fewer before the attention); otherwise ``norm_rope``, then
  ``sparse_attention``.

The model builds `index` per request: the sliding window (W = 128 rows, p−W+1 .. p), then the
compressed entries (all visible ones for HCA, the indexer's top-k for CSA). Decode, verify and
prefill blocks are the same call with S = 1, a few, or many query rows.

Shape symbols: S query rows, H heads, d head_dim, P pool rows, K keys per query.

Fused kernel (flash-decoding): the K keys of a query are split into C chunks so that a single
decode query still spreads over the SMs; program (s, head block, chunk) gathers its keys once for
all heads of the block (MQA: one key row serves every head; the head blocks of one query run back
to back, so the rows they share come from L2), keeps an online softmax (running max
m, sum l, weighted values) in fp32 and writes partials; `_combine_kernel` merges the chunks and the
sink: out = Σ_c acc_c e^{m_c − m} / (e^{sink − m} + Σ_c l_c e^{m_c − m}), m = max(sink, m_c), up to
16 chunks per load (one decode query's merge is a few dependent loads, not one per chunk).
QKᵀ and P·V run on tensor cores with fp32 accumulation (bf16 P; fp32 inputs use 3-pass TF32).
No host sync; CUDA-graph capturable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from dspark.kernels.attention_ref import _check_args, sparse_attention_ref  # noqa: F401 (the op's ref)
from dspark.kernels.attention_ref import _check_qnorm_args, sparse_attention_qnorm_ref  # noqa: F401 (the op's ref)
from dspark.kernels import attention_wide
from dspark.kernels.norm_rope import norm_rope
from dspark.kernels.rope import rotate_pairs
from dspark.kernels.registry import require_triton

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue


# Whether `sparse_attention_qnorm` normalises and rotates V4's q heads inside `_partial_kernel` (below 64 query
# rows, where that kernel runs): the `norm_rope` launch between wq_b and the attention leaves the main lane's
# chain (12 a v4-mini step). A candidate, not yet timed (`bench/graph_decode.py --gemv-ab q_norm_fold`). Not bit
# for bit `norm_rope`: Σq² reduces in this kernel's tile (about 1 ulp of the rsqrt, as `mhc_norm`'s norm).
Q_NORM_FOLD = False

# --------------------------------------------------------------------------------- Triton kernels


@_jit
def _norm_rope_heads(q, cos_row, sin_row, head_dim, half, eps, D_PAD: tl.constexpr):
    """q [BH, D_PAD] (a query's raw heads, storage dtype; padding 0) -> each head RMS-normalised over head_dim
    (unweighted), rounded to q's dtype, its trailing 2·half dims rotated pairwise by the row's cos / sin
    (`cos_row`, `sin_row`: [half] fp32) and rounded again: `norm_rope`'s arithmetic, which runs without FMA
    contraction, so squares and products are fma(a, b, +0) here (`rope.rotate_pairs`; each rounds as the
    product; only Σq²'s order is this tile's)."""
    x = q.to(tl.float32)
    r = tl.math.rsqrt(tl.sum(tl.fma(x, x, 0.0), axis=1) / head_dim + eps)  # [BH]
    x = tl.fma(x, r[:, None], 0.0).to(q.dtype).to(tl.float32)
    j = 2 * tl.arange(0, D_PAD // 2) - (head_dim - 2 * half)  # the pair's index in the rotary dims, < 0: none
    rot = (j >= 0) & (j < 2 * half)
    c = tl.load(cos_row + tl.maximum(j, 0) // 2, mask=rot, other=1.0)[None, :]
    s = tl.load(sin_row + tl.maximum(j, 0) // 2, mask=rot, other=0.0)[None, :]
    return rotate_pairs(x, c, s, rot).to(q.dtype)


@_jit
def _partial_kernel(
    q_ptr, pool_ptr, idx_ptr, m_ptr, l_ptr, acc_ptr,
    n_q, n_heads, head_dim, n_keys, keys_per_chunk, scale, n_hblocks, cos_ptr, sin_ptr, half, eps,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DOT_FP32: tl.constexpr,
    HEADS_FASTEST: tl.constexpr, PREFETCH: tl.constexpr, QNORM: tl.constexpr, PDL: tl.constexpr,
):
    """Online softmax of query s, heads of block hb, over keys [c·keys_per_chunk, (c+1)·...):
    writes m, l [C, S, H] and acc [C, S, H, d] (fp32, un-normalised). QNORM: q holds raw heads, normalised
    and rotated as loaded (`_norm_rope_heads`; cos / sin [S, half] fp32, eps).

    Program (s, hb) is program_id(0) = s·n_hblocks + hb with HEADS_FASTEST (the head blocks of a
    query, which gather the same key rows, run back to back and share them through L2), else
    hb·n_q + s (the query rows of one head block back to back). With PREFETCH the gather of key
    tile t+1 is issued before the math of tile t (register double-buffering: the loop's gathers
    are not pipelined by the compiler, so otherwise each step waits for its own)."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    if HEADS_FASTEST:
        s, hb = pid // n_hblocks, pid % n_hblocks
    else:
        s, hb = pid % n_q, pid // n_q
    s = s.to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.program_id(1)
    h_mask = offs_h < n_heads
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < head_dim
    hd_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (s * n_heads + offs_h)[:, None] * head_dim + offs_d[None, :], mask=hd_mask, other=0.0)
    if QNORM:
        q = _norm_rope_heads(q, cos_ptr + s * half, sin_ptr + s * half, head_dim, half, eps, D_PAD)
    if DOT_FP32:
        q = q.to(tl.float32)
    m = tl.full((BLOCK_H,), -1.0e30, dtype=tl.float32)  # finite: no inf − inf
    l = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, D_PAD), dtype=tl.float32)
    start = c * keys_per_chunk
    end = tl.minimum(start + keys_per_chunk, n_keys)
    if PREFETCH:  # the first tile; each step then issues the next tile's gather before its math
        k_next, valid_next = _gather_tile(pool_ptr, idx_ptr, s * n_keys, start, end, head_dim, offs_d, d_mask,
                                          BLOCK_N)
    for n0 in range(0, keys_per_chunk, BLOCK_N):  # fixed trip count: the interpreter needs it
        if PREFETCH:
            k, valid = k_next, valid_next
            k_next, valid_next = _gather_tile(pool_ptr, idx_ptr, s * n_keys, start + n0 + BLOCK_N, end, head_dim,
                                              offs_d, d_mask, BLOCK_N)
        else:
            k, valid = _gather_tile(pool_ptr, idx_ptr, s * n_keys, start + n0, end, head_dim, offs_d, d_mask,
                                    BLOCK_N)
        if DOT_FP32:
            k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="tf32x3")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))  # [BH, BN]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        if DOT_FP32:
            acc = tl.dot(p, k, acc * alpha[:, None], input_precision="tf32x3")
        else:
            # P·V takes P in the keys' dtype; l sums that same rounded P, so the weights of the
            # values stay exactly normalised (no bias from rounding P, whatever the rounding mode).
            p = p.to(k.dtype)
            acc = tl.dot(p, k, acc * alpha[:, None])
            p = p.to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    part = (c * n_q + s) * n_heads + offs_h  # [BH]
    tl.store(m_ptr + part, m, mask=h_mask)
    tl.store(l_ptr + part, l, mask=h_mask)
    tl.store(acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=hd_mask)


@_jit
def _gather_tile(pool_ptr, idx_ptr, row_base, first, end, head_dim, offs_d, d_mask, BLOCK_N: tl.constexpr):
    """Keys first .. first+BLOCK_N−1 (< end) of the index row at `row_base`: (rows [BN, D] of the
    pool, key and value; valid [BN], False for −1 and out-of-range keys)."""
    offs_n = first + tl.arange(0, BLOCK_N)
    rows = tl.load(idx_ptr + row_base + offs_n, mask=offs_n < end, other=-1).to(tl.int64)
    valid = rows >= 0
    k = tl.load(pool_ptr + rows[:, None] * head_dim + offs_d[None, :], mask=valid[:, None] & d_mask[None, :],
                other=0.0)
    return k, valid


@_jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, sink_ptr, out_ptr, n_q, n_heads, head_dim, n_chunks,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    """out[s, heads of block, d-block] = merged chunks with the sink in the denominator, cast to
    out's dtype (each d-block recomputes m and l: [BLOCK_H] work, cheaper than another pass).

    BLOCK_C chunks are loaded and merged per step: at one decode query the merge is latency bound,
    and a step per chunk was n_chunks dependent loads (BLOCK_C = 1 keeps that order of sums)."""
    pdl_prologue(PDL)
    s = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < n_heads
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    offs_c = tl.arange(0, BLOCK_C)
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    m = sink
    for c0 in range(0, n_chunks, BLOCK_C):
        part = ((c0 + offs_c)[:, None] * n_q + s) * n_heads + offs_h[None, :]  # [BC, BH]
        ok = ((c0 + offs_c) < n_chunks)[:, None] & h_mask[None, :]
        m = tl.maximum(m, tl.max(tl.load(m_ptr + part, mask=ok, other=-1.0e30), axis=0))
    l = tl.exp(sink - m)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for c0 in range(0, n_chunks, BLOCK_C):
        part = ((c0 + offs_c)[:, None] * n_q + s) * n_heads + offs_h[None, :]
        ok = ((c0 + offs_c) < n_chunks)[:, None] & h_mask[None, :]
        w = tl.exp(tl.load(m_ptr + part, mask=ok, other=-1.0e30) - m[None, :])  # [BC, BH]; 0 off the chunks
        l += tl.sum(w * tl.load(l_ptr + part, mask=ok, other=0.0), axis=0)
        values = tl.load(acc_ptr + part[:, :, None] * head_dim + offs_d[None, None, :],
                         mask=ok[:, :, None] & d_mask[None, None, :], other=0.0)  # [BC, BH, BD]
        acc += tl.sum(w[:, :, None] * values, axis=0)
    out = acc / l[:, None]
    tl.store(out_ptr + (s * n_heads + offs_h)[:, None] * head_dim + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


def combine_blocks(n_chunks: int, block_h: int, d_pad: int, combine_chunks: int) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_D) of `_combine_kernel`: up to `combine_chunks` chunks per step and d-blocks of
    at most 128 columns (a [BLOCK_H, 512] fp32 tile would spill registers), the [BLOCK_C, BLOCK_H,
    BLOCK_D] fp32 tile at most 4096 elements when it merges several chunks (combine_chunks 1 keeps the
    former [BLOCK_H, 128] tiles). v4-mini's decode query (32 heads in 2 blocks of 16, 10 chunks for
    CSA at 4K) merges in 64 programs of 16 chunks x 16 heads x 16 columns; the former launch took 8
    programs of 10 steps, 4.7 µs (H200 graph profile s9)."""
    block_c = min(combine_chunks, triton.next_power_of_2(n_chunks), max(1, 4096 // (16 * block_h)))
    if block_c == 1:
        return 1, min(d_pad, 128)
    return block_c, max(16, min(d_pad, 128, 4096 // (block_c * block_h)))


# ------------------------------------------------------------------------------------- launcher


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # Triton interpreter on CPU: few programs keep it fast, yet > 1 chunk is exercised


@dataclass(frozen=True)
class Tiles:
    """Launch shape of the flash-decoding pass: BLOCK_H heads × BLOCK_N keys per step, warps, software
    pipeline stages, the grid target (the keys are split into chunks until the grid covers about
    `waves` × SMs programs, keeping >= `min_chunk_tiles` key tiles per chunk), the program order and
    whether each step prefetches the next key tile (`_partial_kernel`).

    `wide` runs `attention_wide._wide_kernel` instead (decode / verify-sized batches): block_h may
    cover every head, `value_split` (1 or 2) programs share a query's value columns, and a launch
    with one key chunk writes the output directly; heads_fastest and prefetch do not apply.

    `combine_chunks` (a power of two): key chunks `_combine_kernel` merges per step (1: one chunk per
    step, the former merge; `combine_blocks`)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int = 3  # Triton's default on CUDA
    waves: int = 2
    heads_fastest: bool = True
    prefetch: bool = False
    min_chunk_tiles: int = 4
    wide: bool = False
    value_split: int = 1
    combine_chunks: int = 16

    def __post_init__(self):
        for name in ("block_h", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Tiles.{name} must be a power of two >= 16 (tl.dot), got {value}")
        if self.value_split not in (1, 2) or (self.value_split == 2 and not self.wide):
            raise ValueError(f"Tiles.value_split must be 1, or 2 with wide=True, got {self.value_split}")
        if self.combine_chunks < 1 or self.combine_chunks & (self.combine_chunks - 1):
            raise ValueError(f"Tiles.combine_chunks must be a power of two >= 1, got {self.combine_chunks}")
        for name in ("num_warps", "num_stages", "waves", "min_chunk_tiles"):
            if getattr(self, name) < 1:
                raise ValueError(f"Tiles.{name} must be >= 1, got {getattr(self, name)}")


def default_tiles(n_heads: int, head_dim: int) -> Tiles:
    """Every head of a key tile in one program when they fit (the keys are then read once),
    otherwise 16-head blocks; tl.dot needs >= 16 on each side. 32-key tiles: on one H200 at 32K
    context (bench/attn_batched.py, `attn_tiles`) they beat 16-key tiles at head_dim 512 by 1.6×
    (V4-Flash, 128 requests) and 1.1× (v4-mini, 8 and 128), and tie at V4-Flash with 8 requests."""
    block_h = max(16, min(64, triton.next_power_of_2(n_heads)))
    d_pad = triton.next_power_of_2(head_dim)
    if block_h * d_pad > 16 * 512:  # the fp32 accumulator [BLOCK_H, d] must stay in registers
        block_h = max(16, 16 * 512 // d_pad)
    return Tiles(block_h, 32, 8 if d_pad >= 256 else 4)


# From this many query rows on (decode / verify batches), head_dim 512 and at most 64 heads, the op runs
# `attention_wide` with every head in one program. On one H200 at 32K context (bench/attn_variants.py,
# `attn-variants-h200.json`, graph replays, L2 flushed) it took, against the shipped kernel:
# v4-mini CSA 59.4 / 140.0 / 272.9 µs vs 65.7 / 165.5 / 324.8 at 64 / 256 / 512 queries, V4-Flash CSA
# 67.7 / 132.4 / 257.0 vs 89.8 / 316.8 / 616.8, V4-Flash HCA 51.4 / 87.9 / 170.1 vs 60.2 / 200.5 / 389.0;
# at 1 and 8 queries the shipped kernel was faster (17.0 vs 22.8 µs, v4-mini CSA at 1).
WIDE_MIN_QUERIES = 64


def wide_tiles(n_heads: int) -> Tiles:
    """`attention_wide`'s launch shape measured best at 64+ queries (`all_s4_waves1`): every head of a
    query in one program, 32-key tiles, 8 warps, 4 pipeline stages, a grid target of one wave."""
    return Tiles(max(16, triton.next_power_of_2(n_heads)), 32, 8, num_stages=4, waves=1, wide=True)


def op_tiles(n_q: int, n_heads: int, head_dim: int) -> Tiles:
    """The launch shape `sparse_attention` takes for n_q query rows."""
    if n_q >= WIDE_MIN_QUERIES and n_heads <= 64 and triton.next_power_of_2(head_dim) == 512:  # as measured
        return wide_tiles(n_heads)
    tiles = default_tiles(n_heads, head_dim)
    if n_q == 1:
        # One query (batch-1 decode): 2-tile chunks, more programs for its few keys. On one H200
        # (bench/attn_decode_chunks.py, v4-mini, graph replays) 16.9 vs 18.9 µs (CSA, 4K), 12.4 vs
        # 14.2 (HCA, 4K), 14.4 vs 17.9 (HCA, 32K); from 8 queries on, 4-tile chunks were as fast or faster.
        tiles = replace(tiles, min_chunk_tiles=2)
    return tiles


def sparse_attention(q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Fused `sparse_attention_ref` (same signature, shapes and dtypes)."""
    return launch_sparse_attention(q, pool, index, sink, scale, op_tiles(*q.shape))


def sparse_attention_qnorm(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
                           index: torch.Tensor, sink: torch.Tensor, scale: float, *, eps: float) -> torch.Tensor:
    """Fused `sparse_attention_qnorm_ref` (same signature): with Q_NORM_FOLD and `_partial_kernel`'s tiles, one
    attention whose programs normalise and rotate the q tiles they load; otherwise `norm_rope`, then
    `sparse_attention`."""
    _check_qnorm_args(q, cos, sin, eps)
    tiles = op_tiles(*q.shape)
    if _folds(tiles):
        return launch_sparse_attention(q, pool, index, sink, scale, tiles, qnorm=(cos, sin, eps))
    return sparse_attention(norm_rope(q, None, cos.unsqueeze(-2), sin.unsqueeze(-2), eps=eps), pool, index, sink, scale)


def q_norm_folds(n_q: int, n_heads: int, head_dim: int) -> bool:
    """Whether `sparse_attention_qnorm` folds the q norm for q [n_q, n_heads, head_dim]: Q_NORM_FOLD and
    `_partial_kernel`'s tiles. Where it does not, V4's static step normalises q itself, where it always has
    (before the side lanes' joins), and calls `sparse_attention`: the op's unfolded path would move that
    launch after the joins (`sparse_attention_qnorm.folds`)."""
    return _folds(op_tiles(n_q, n_heads, head_dim))


def _folds(tiles: Tiles) -> bool:
    """Q_NORM_FOLD where the op's launch shape is `_partial_kernel`'s (not `attention_wide`'s)."""
    return Q_NORM_FOLD and not tiles.wide


sparse_attention_qnorm.folds = q_norm_folds  # the static step asks the op it holds (`LatentAttention.attend_qnorm_op`)


def launch_sparse_attention(q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor, sink: torch.Tensor,
                            scale: float, tiles: Tiles, *, qnorm: tuple | None = None) -> torch.Tensor:
    """`sparse_attention` with explicit `tiles` (the bench sweeps them; the model uses the default). With
    `qnorm` = (cos, sin, eps): `sparse_attention_qnorm`'s fold (q raw; `_partial_kernel`'s tiles only)."""
    require_triton()
    _check_args(q, pool, index, sink)
    if qnorm is not None:
        _check_qnorm_args(q, *qnorm)
        if tiles.wide:
            raise ValueError("the q norm fold runs in _partial_kernel only, not with wide tiles")
    n_q, n_heads, head_dim = q.shape
    n_keys = index.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n_q == 0:
        return out
    block_h, block_n = tiles.block_h, tiles.block_n
    d_pad = max(16, triton.next_power_of_2(head_dim))
    n_hblocks = triton.cdiv(n_heads, block_h)
    per_chunk_row = n_q * n_hblocks * tiles.value_split  # programs per key chunk
    max_chunks = max(1, triton.cdiv(n_keys, tiles.min_chunk_tiles * block_n))
    n_chunks = max(1, min(max_chunks, triton.cdiv(tiles.waves * _num_sms(q.device), per_chunk_row)))
    keys_per_chunk = triton.cdiv(triton.cdiv(max(n_keys, 1), n_chunks), block_n) * block_n
    n_chunks = triton.cdiv(max(n_keys, 1), keys_per_chunk)
    q, pool, index = q.contiguous(), pool.contiguous(), index.contiguous()
    sink = sink.float().contiguous()
    if tiles.wide and n_chunks == 1:  # the kernel writes `out` itself
        attention_wide.launch_wide(q, pool, index, sink, out, (out, out, out), scale, tiles, n_hblocks, 1,
                                   keys_per_chunk, d_pad)
        return out
    m = torch.empty((n_chunks, n_q, n_heads), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((n_chunks, n_q, n_heads, head_dim), dtype=torch.float32, device=q.device)
    if tiles.wide:
        attention_wide.launch_wide(q, pool, index, sink, out, (m, l, acc), scale, tiles, n_hblocks, n_chunks,
                                   keys_per_chunk, d_pad)
    else:
        dot_fp32 = q.dtype == torch.float32 or pool.dtype == torch.float32
        grid = (n_q * n_hblocks, n_chunks)
        pdl = pdl_launch(q.device, math.prod(grid))
        cos, sin, eps = (m, m, 1.0) if qnorm is None else (qnorm[0].float().contiguous(), qnorm[1].float().contiguous(),
                                                           float(qnorm[2]))  # unread without QNORM
        _partial_kernel[grid](
            q, pool, index, m, l, acc,
            n_q, n_heads, head_dim, n_keys, keys_per_chunk, float(scale), n_hblocks, cos, sin, cos.shape[-1], eps,
            BLOCK_H=block_h, BLOCK_N=block_n, D_PAD=d_pad, DOT_FP32=dot_fp32, HEADS_FASTEST=tiles.heads_fastest,
            PREFETCH=tiles.prefetch, QNORM=qnorm is not None, PDL=pdl, launch_pdl=pdl,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    block_c, block_d = combine_blocks(n_chunks, block_h, d_pad, tiles.combine_chunks)
    grid = (n_q, n_hblocks, triton.cdiv(head_dim, block_d))
    pdl = pdl_launch(q.device, math.prod(grid))
    _combine_kernel[grid](
        m, l, acc, sink, out, n_q, n_heads, head_dim, n_chunks,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_C=block_c, PDL=pdl, launch_pdl=pdl, num_warps=4,
    )
    return out

