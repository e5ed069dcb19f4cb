"""Decode-sized MoE experts (M = 1..8 tokens): GEMV kernels straight over the picked experts' weights.

The packed path of `moe.moe_experts` sorts the N·K assignments by expert and pads each group to a
16-row tensor-core tile; for a handful of tokens that bookkeeping (a dozen small torch ops plus five
kernel launches) costs more than reading the weights. Here each (token, expert) assignment is one
row of work and nothing is packed:

1. `_decode_up_kernel`, grid (N·K + N, ⌈I/BLOCK_N⌉): row a < N·K is assignment a (token a // K,
   expert ids[a]); row N·K + t is token t's shared expert. h[a] = silu(min(x·W1ᵀ, L)) ·
   clamp(x·W3ᵀ, −L, L), kept in fp32.
2. `_decode_down_kernel`, grid (N, ⌈D/BLOCK_N⌉): y[t] = h[shared t]·W2_sᵀ + Σ_k w[t, k] ·
   h[t·K + k]·W2[ids[t, k]]ᵀ, accumulated in fp32 and cast once: the down projection and the
   finalize are one pass, so the routed rows never reach memory. With `DecodeTiles.down_split` S > 1
   the grid gains an axis of S programs that share the K + 1 expert slots of a row block; each stores
   its fp32 sum, and the last to take a ticket (a counter per row block, zeroed by the up kernel and
   put back to 0 after) adds the S sums in a fixed order and casts: more programs in flight, the same
   bits on every run.

Two launches, no host sync, CUDA-graph capturable. On Hopper the tables send either launch through TMA
(`moe_decode_tma`: `UP_TMA`, `DOWN_TMA`) or, where it won, both through one (`FUSED`). Weights may be dense
or `FP8BlockWeight` (dequantised per tile in registers, as in the packed kernels). Shape symbols as in
`moe.py`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from dspark.kernels import moe_decode_tma
from dspark.kernels.moe import _block_k, _clamped_swiglu, _jit, _split_store, _weight_parts, _weight_tile, tl, triton
from dspark.kernels.moe_decode_tma import TmaTiles
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue

_BLOCK_N = 16  # output rows per program: small, so that one token still spreads over the SMs
_BLOCK_K = 128  # reduction step; FP8 weights cap it at the scale block


@_jit
def _gemv(v_ptr, w_ptr, s_ptr, e, offs_n, n_out, n_in, FP8: tl.constexpr, SB: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_N]: W[e, offs_n, :] · v for one input row v (n_in long) of any float dtype."""
    acc = tl.zeros(offs_n.shape, dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        acc += _gemv_step(v_ptr, w_ptr, s_ptr, e, offs_n, n_out, n_in, k0, FP8, SB, BLOCK_K)
    return acc


@_jit
def _gemv_step(v_ptr, w_ptr, s_ptr, e, offs_n, n_out, n_in, k0, FP8: tl.constexpr, SB: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_N]: one reduction step of `_gemv`, columns k0 .. k0 + BLOCK_K."""
    if FP8:
        if BLOCK_K > SB:  # several scale blocks per step (`_common` makes BLOCK_K a multiple of SB)
            return _gemv_fp8_step(v_ptr, w_ptr, s_ptr, e, offs_n, n_out, n_in, k0, SB, BLOCK_K // SB, SB)
        return _gemv_fp8_step(v_ptr, w_ptr, s_ptr, e, offs_n, n_out, n_in, k0, SB, 1, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    v = tl.load(v_ptr + offs_k, mask=offs_k < n_in, other=0.0).to(tl.float32)
    w = _weight_tile(w_ptr, s_ptr, e, offs_n, offs_k, k0, n_out, n_in, FP8, SB, tl.float32)
    return tl.sum(w * v[None, :], axis=1)


@_jit
def _gemv_fp8_step(v_ptr, w_ptr, s_ptr, e, offs_n, n_out, n_in, k0, SB: tl.constexpr, KB: tl.constexpr,
                   SUB: tl.constexpr):
    """`_gemv_step` of an FP8 weight, KB sub-blocks of SUB columns (SUB <= SB, each within one scale
    column): each sub-block's dot product is summed in fp32 and then scaled by its UE8M0 factor, a
    power of two, so the result equals scaling every weight first (one multiply per sub-block
    instead of per weight: the dequantising multiply was the CUDA cores' bottleneck)."""
    n_mask = offs_n < n_out
    rows = w_ptr + e * n_out * n_in + offs_n.to(tl.int64)[:, None, None] * n_in
    s_row = (e * tl.cdiv(n_out, SB) + offs_n // SB)[:, None] * tl.cdiv(n_in, SB)
    first = k0 + tl.arange(0, KB) * SUB  # [KB] first column of each sub-block
    cols = first[:, None] + tl.arange(0, SUB)[None, :]  # [KB, SUB]
    c_mask = cols < n_in
    v = tl.load(v_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
    w = tl.load(rows + cols[None, :, :], mask=n_mask[:, None, None] & c_mask[None, :, :], other=0.0)
    part = tl.sum(w.to(tl.float32) * v[None, :, :], axis=2)  # [BLOCK_N, KB]
    byte = tl.load(s_ptr + s_row + (first // SB)[None, :], mask=n_mask[:, None] & (first < n_in)[None, :],
                   other=127)
    factor = (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127), exact
    return tl.sum(part * factor, axis=1)


@_jit
def _gemv_acc(acc, v_ptr, w_ptr, s_ptr, e, n0, n_out, n_in, mult, FP8: tl.constexpr, SB: tl.constexpr,
              BLOCK_K: tl.constexpr, STAGES: tl.constexpr = 1):
    """acc [BLOCK_N, KB, SUB] fp32 plus W[e, n0 + i, k] · (mult · v[k]) at k's place, over the whole row:
    every K step only loads and multiplies-adds, and the caller sums the columns once (`_acc_sum`),
    where `_gemv` reduces across the program's threads at every step (warp shuffles, a barrier, before
    the next step's loads may issue). FP8 weights times their UE8M0 factors: when the program's rows
    share one scale row (BLOCK_N divides SB), one factor per sub-block, folded into v; else per row
    and sub-block. Dense weights: KB = 1, SUB = BLOCK_K. STAGES > 1: the K loop software-pipelined."""
    BLOCK_N: tl.constexpr = acc.shape[0]
    KB: tl.constexpr = acc.shape[1]
    SUB: tl.constexpr = acc.shape[2]
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    rows = w_ptr + e * n_out * n_in + offs_n.to(tl.int64)[:, None, None] * n_in
    for k0 in tl.range(0, n_in, BLOCK_K, num_stages=STAGES):
        first = k0 + tl.arange(0, KB) * SUB  # [KB] first column of each sub-block
        cols = first[:, None] + tl.arange(0, SUB)[None, :]  # [KB, SUB]
        c_mask = cols < n_in
        v = tl.load(v_ptr + cols, mask=c_mask, other=0.0).to(tl.float32) * mult
        w = tl.load(rows + cols[None, :, :], mask=n_mask[:, None, None] & c_mask[None, :, :], other=0.0)
        if FP8:
            s_cols = tl.cdiv(n_in, SB)
            if tl.constexpr(SB) % BLOCK_N == 0:  # n0 is a multiple of BLOCK_N: all rows in scale row n0 // SB
                byte = tl.load(s_ptr + (e * tl.cdiv(n_out, SB) + n0 // SB) * s_cols + first // SB,
                               mask=first < n_in, other=127)
                factor = (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127), exact
                acc += w.to(tl.float32) * (v * factor[:, None])[None, :, :]
            else:
                s_row = (e * tl.cdiv(n_out, SB) + offs_n // SB) * s_cols
                byte = tl.load(s_ptr + s_row[:, None] + (first // SB)[None, :],
                               mask=n_mask[:, None] & (first < n_in)[None, :], other=127)
                factor = (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
                acc += w.to(tl.float32) * factor[:, :, None] * v[None, :, :]
        else:
            acc += w.to(tl.float32) * v[None, :, :]
    return acc


@_jit
def _acc_sum(acc):
    """fp32 [BLOCK_N]: `_gemv_acc`'s accumulator summed over its columns."""
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@_jit
def _swiglu_row(x_row_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, e, offs_n, n_out, dim, limit,
                FP8: tl.constexpr, SB: tl.constexpr, CLAMP: tl.constexpr, BLOCK_K: tl.constexpr,
                STAGES: tl.constexpr, DEFER: tl.constexpr, KB: tl.constexpr, SUB: tl.constexpr):
    """Clamped SwiGLU of one token for rows offs_n of expert e, fp32 [BLOCK_N]. STAGES > 1: gate and
    up in one loop (both weights' tiles loaded per step), software-pipelined over STAGES steps; the
    same sums in the same order, so the same bits."""
    if DEFER:
        zero = tl.zeros((offs_n.shape[0], KB, SUB), dtype=tl.float32)
        n0 = tl.program_id(1) * offs_n.shape[0]
        gate = _acc_sum(_gemv_acc(zero, x_row_ptr, w1_ptr, s1_ptr, e, n0, n_out, dim, 1.0, FP8, SB, BLOCK_K, STAGES))
        up = _acc_sum(_gemv_acc(zero, x_row_ptr, w3_ptr, s3_ptr, e, n0, n_out, dim, 1.0, FP8, SB, BLOCK_K, STAGES))
    elif STAGES > 1:
        gate = tl.zeros(offs_n.shape, dtype=tl.float32)
        up = tl.zeros(offs_n.shape, dtype=tl.float32)
        for k0 in tl.range(0, dim, BLOCK_K, num_stages=STAGES):
            gate += _gemv_step(x_row_ptr, w1_ptr, s1_ptr, e, offs_n, n_out, dim, k0, FP8, SB, BLOCK_K)
            up += _gemv_step(x_row_ptr, w3_ptr, s3_ptr, e, offs_n, n_out, dim, k0, FP8, SB, BLOCK_K)
    else:
        gate = _gemv(x_row_ptr, w1_ptr, s1_ptr, e, offs_n, n_out, dim, FP8, SB, BLOCK_K)
        up = _gemv(x_row_ptr, w3_ptr, s3_ptr, e, offs_n, n_out, dim, FP8, SB, BLOCK_K)
    return _clamped_swiglu(gate, up, limit, CLAMP)


@_jit
def _decode_up_kernel(
    x_ptr, ids_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, h_ptr, ticket_ptr,
    n_assign, dim, inter, inter_s, h_width, limit,
    TOP_K: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr, FP8_S: tl.constexpr, SB_S: tl.constexpr,
    CLAMP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_K_S: tl.constexpr,
    STAGES: tl.constexpr, DEFER: tl.constexpr, KB: tl.constexpr, SUB: tl.constexpr, KB_S: tl.constexpr,
    SUB_S: tl.constexpr, TICKETS: tl.constexpr, PDL: tl.constexpr,
):
    """h[a, offs_n] for one work row a (routed assignment or shared expert of a token). TICKETS > 0:
    programs (a < N, 0) also zero token a's TICKETS counters of the split down kernel (`ticket_ptr`)."""
    pdl_prologue(PDL)
    a = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if TICKETS > 0:
        if (a < n_assign // TOP_K) & (tl.program_id(1) == 0):
            offs_c = tl.arange(0, TICKETS)
            tl.store(ticket_ptr + a * TICKETS + offs_c, tl.zeros((TICKETS,), dtype=tl.int32))
    if a < n_assign:
        e = tl.load(ids_ptr + a).to(tl.int64)
        x_row = x_ptr + (a // TOP_K).to(tl.int64) * dim
        h = _swiglu_row(x_row, w1_ptr, w3_ptr, s1_ptr, s3_ptr, e, offs_n, inter, dim, limit,
                        FP8, SB, CLAMP, BLOCK_K, STAGES, DEFER, KB, SUB)
        n_out = inter
    else:
        x_row = x_ptr + (a - n_assign).to(tl.int64) * dim
        h = _swiglu_row(x_row, sw1_ptr, sw3_ptr, ss1_ptr, ss3_ptr, 0, offs_n, inter_s, dim, limit,
                        FP8_S, SB_S, CLAMP, BLOCK_K_S, STAGES, DEFER, KB_S, SUB_S)
        n_out = inter_s
    tl.store(h_ptr + a.to(tl.int64) * h_width + offs_n, h, mask=offs_n < n_out)


@_jit
def _routed_down(h_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, t, offs_n, dim, inter, h_width, TOP_K: tl.constexpr,
                 FP8: tl.constexpr, SB: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """fp32 [BLOCK_N]: Σ_k w[t, k] · (h[t·K + k] · W2[ids[t, k]]ᵀ) for rows offs_n, reduced at every step."""
    acc = tl.zeros(offs_n.shape, dtype=tl.float32)
    if STAGES > 1:
        n_steps = tl.cdiv(inter, BLOCK_K)
        for i in tl.range(0, TOP_K * n_steps, num_stages=STAGES):
            k = i // n_steps
            a = t * TOP_K + k
            e = tl.load(ids_ptr + a).to(tl.int64)
            weight = tl.load(wts_ptr + a)
            acc += weight * _gemv_step(h_ptr + a * h_width, w2_ptr, s2_ptr, e, offs_n, dim, inter,
                                       (i - k * n_steps) * BLOCK_K, FP8, SB, BLOCK_K)
    else:
        for k in tl.static_range(TOP_K):
            a = t * TOP_K + k
            e = tl.load(ids_ptr + a).to(tl.int64)
            weight = tl.load(wts_ptr + a)
            acc += weight * _gemv(h_ptr + a * h_width, w2_ptr, s2_ptr, e, offs_n, dim, inter, FP8, SB, BLOCK_K)
    return acc


@_jit
def _down_slot(j: tl.constexpr, h_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, t, offs_n, n0,
               n_assign, dim, inter, inter_s, h_width, TOP_K: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr,
               FP8_S: tl.constexpr, SB_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_K_S: tl.constexpr,
               DEFER: tl.constexpr, KB: tl.constexpr, SUB: tl.constexpr, KB_S: tl.constexpr, SUB_S: tl.constexpr):
    """fp32 [BLOCK_N]: expert slot j of token t for rows offs_n: j = 0 the shared expert, j = 1..K the
    routed ones, weighted (the split down kernel's unit of work)."""
    if j == 0:
        if DEFER:
            zero_s = tl.zeros((offs_n.shape[0], KB_S, SUB_S), dtype=tl.float32)
            out = _acc_sum(_gemv_acc(zero_s, h_ptr + (n_assign + t) * h_width, sw2_ptr, ss2_ptr, 0, n0, dim,
                                     inter_s, 1.0, FP8_S, SB_S, BLOCK_K_S))
        else:
            out = _gemv(h_ptr + (n_assign + t) * h_width, sw2_ptr, ss2_ptr, 0, offs_n, dim, inter_s,
                        FP8_S, SB_S, BLOCK_K_S)
    else:
        a = t * TOP_K + (j - 1)
        e = tl.load(ids_ptr + a).to(tl.int64)
        weight = tl.load(wts_ptr + a)
        if DEFER:
            zero = tl.zeros((offs_n.shape[0], KB, SUB), dtype=tl.float32)
            out = _acc_sum(_gemv_acc(zero, h_ptr + a * h_width, w2_ptr, s2_ptr, e, n0, dim, inter, weight,
                                     FP8, SB, BLOCK_K))
        else:
            out = weight * _gemv(h_ptr + a * h_width, w2_ptr, s2_ptr, e, offs_n, dim, inter, FP8, SB, BLOCK_K)
    return out


@_jit
def _decode_down_kernel(
    h_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, y_ptr, part_ptr, ticket_ptr,
    n_assign, dim, inter, inter_s, h_width, ticket_stride,
    TOP_K: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr, FP8_S: tl.constexpr, SB_S: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_K_S: tl.constexpr, STAGES: tl.constexpr,
    DEFER: tl.constexpr, KB: tl.constexpr, SUB: tl.constexpr, KB_S: tl.constexpr, SUB_S: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """y[t, offs_n] = shared + Σ_k w[t, k] · (h[t·K + k] · W2[ids[t, k]]ᵀ), one cast at the end.
    STAGES > 1: the routed experts' steps in one flat loop, software-pipelined over STAGES steps so
    the next expert's tiles load while this one's are summed (each step's partial is weighted, not
    each expert's sum: the same value up to fp32 rounding). DEFER: `_gemv_acc`'s accumulators, the
    routing weights folded into h, two column sums in all (the shared expert's, the routed ones').
    SPLIT > 1 (grid axis 2): program s takes the expert slots j ≡ s (mod SPLIT) (`_down_slot`) and
    stores its fp32 sum in part[t, s]; the last of the SPLIT programs of (t, row block) to take a
    ticket sums the parts in order s = 0..SPLIT−1 (the same bits whichever arrives last), stores y and
    puts the ticket counter back to 0 (zeroed by the up kernel)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if SPLIT > 1:
        s = tl.program_id(2)
        n_mask = offs_n < dim
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(TOP_K + 1):
            if s == j % SPLIT:
                acc += _down_slot(j, h_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, t, offs_n, n0,
                                  n_assign, dim, inter, inter_s, h_width, TOP_K, FP8, SB, FP8_S, SB_S, BLOCK_K,
                                  BLOCK_K_S, DEFER, KB, SUB, KB_S, SUB_S)
        _split_store(y_ptr, part_ptr, ticket_ptr, acc, t, s, offs_n, n_mask, dim, ticket_stride, SPLIT,
                     tl.program_id(1))
    else:
        acc = _down_slot(0, h_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, t, offs_n, n0, n_assign, dim,
                         inter, inter_s, h_width, TOP_K, FP8, SB, FP8_S, SB_S, BLOCK_K, BLOCK_K_S, DEFER, KB, SUB,
                         KB_S, SUB_S)  # the shared expert
        if DEFER:  # the routed experts in one deferred accumulator, one column sum
            routed = tl.zeros((BLOCK_N, KB, SUB), dtype=tl.float32)
            for k in tl.static_range(TOP_K):
                a = t * TOP_K + k
                e = tl.load(ids_ptr + a).to(tl.int64)
                routed = _gemv_acc(routed, h_ptr + a * h_width, w2_ptr, s2_ptr, e, n0, dim, inter,
                                   tl.load(wts_ptr + a), FP8, SB, BLOCK_K, STAGES)
            acc += _acc_sum(routed)
        else:
            acc += _routed_down(h_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, t, offs_n, dim, inter, h_width,
                                TOP_K, FP8, SB, BLOCK_K, STAGES)
        tl.store(y_ptr + t * dim + offs_n, acc.to(y_ptr.dtype.element_ty), mask=offs_n < dim)


class DecodeTiles(NamedTuple):
    """Launch shape of the two kernels: output rows per program (`up_n`, `down_n`), reduction
    step (`up_k`, `down_k`; FP8 weights cap it at their scale block), warps per program and the
    software pipeline's depth (`stages`; 1, the measured tables' value, keeps the expert loops apart)."""

    up_n: int = _BLOCK_N
    down_n: int = _BLOCK_N
    up_k: int = _BLOCK_K
    down_k: int = _BLOCK_K
    up_warps: int = 4
    down_warps: int = 4
    stages: int = 1  # > 1: each kernel's steps in one software-pipelined loop of this many stages
    up_defer: bool = False  # True: the kernel's column sums deferred to the end of each row (`_gemv_acc`,
    down_defer: bool = False  # its K loops pipelined over `stages`; the routed experts stay apart)
    down_split: int = 1  # > 1: the down kernel's expert slots (shared + K routed) over this many programs
    # per row block, their fp32 sums added in a fixed order by the last to finish (stages 1 only)
    up_tma: TmaTiles | None = None  # the gate/up launch through TMA at these tiles (`moe_decode_tma`) where
    # it runs (`moe_decode_tma.supported`); up_n, up_k, up_warps, stages and up_defer are then unused
    down_tma: TmaTiles | None = None  # the down launch through TMA at these tiles, its expert slots over
    # `down_split` programs per row block, where it runs; down_n, down_k, down_warps, down_defer then unused
    fused: tuple[TmaTiles, TmaTiles] | None = None  # the experts in one launch (`moe_decode_tma.tma_fused`) at
    # these (gate/up, down) tiles where it runs; every other field is then unused


# Picked per kernel from `bench/moe_decode_tiles.py` on one H200, per layer width. V4-Flash-like layers
# (D 4096, I 2048, top-6 of 256; bench/results/moe-decode-tiles-h200.json): at one token, 8-row programs
# with long reduction steps (more programs in flight per SM hide the weight stream's latency; 53 % -> 68 %
# of HBM for dense weights); at 8 tokens, 16-row programs and 256-wide steps (89 % -> 88-92 % per
# kernel). Layers of width D <= 2048 (v4-mini: I 512, top-6 of 64; `--layers v4-mini --wide --graph`,
# moe-decode-tiles-mini-h200.json, CUDA-graph replays): at one token 4-row programs reading the whole
# row in one or two steps, 37.7 -> 21.4 µs per layer for dense weights (the V4-Flash shapes left most
# SMs waiting on a few long rows); at 8 tokens the uniform 16-row, 128-wide shape. FP8 (128×128) at one
# token: steps over 2-4 scale blocks (`_gemv_fp8`; `--kinds fp8 --tokens 1 --wide --graph`,
# moe-decode-tiles-fp8-h200.json): V4-Flash 114.8 -> 80.6 µs (35 -> 50 % of HBM), v4-mini 39.1 ->
# 19.2 µs. FP8 steps of up to whole rows (`--kinds fp8 --graph --fp8-steps 256,512,1024,2048 --rows
# 4,8,16,32`, moe-decode-tiles-fp8-wide-h200.json; more weight bytes in flight per program): at one
# token V4-Flash up 46.8 -> 43.8 µs, down 33.8 -> 29.9 µs; v4-mini 19.8 µs for the op -> 10.9 for
# the kernel pair; at 8 tokens 16-32 scale blocks per step (V4-Flash op 340 µs -> pair 327 µs, v4-mini
# 58 -> 51). Column sums deferred to the end of each row (`_gemv_acc`; `--defer 0,1`,
# moe-decode-tiles-defer-bf16-h200.json): V4-Flash bf16 at one token 103.5 -> 96.5 µs for the op (77 ->
# 83 % of HBM), down kernel 41.3 -> 38.1 µs at its best shape; no gain for v4-mini (23.6 vs 24.6) or FP8
# weights (moe-decode-tiles-defer-fp8-h200.log: one token 67.6 vs 74.3, 8 tokens 324.0 vs 404.9), which
# keep the per-step sums. The uniform shape before these tables is `DecodeTiles()`.
_MEASURED = {  # (FP8 scale block or None for dense weights, one token, D <= 2048) -> tiles
    (None, True, False): DecodeTiles(up_n=8, down_n=4, up_k=512, down_k=512, up_warps=4, down_warps=4,
                                     up_defer=True, down_defer=True),
    (None, False, False): DecodeTiles(up_n=16, down_n=16, up_k=256, down_k=256, up_warps=4, down_warps=8),
    (128, True, False): DecodeTiles(up_n=8, down_n=16, up_k=2048, down_k=1024, up_warps=4, down_warps=8),
    (128, False, False): DecodeTiles(up_n=32, down_n=32, up_k=1024, down_k=512, up_warps=4, down_warps=4),
    (None, True, True): DecodeTiles(up_n=4, down_n=8, up_k=1024, down_k=512, up_warps=8, down_warps=4,
                                    down_split=4),
    (None, False, True): DecodeTiles(up_n=16, down_n=16, up_k=128, down_k=128, up_warps=4, down_warps=4),
    (128, True, True): DecodeTiles(up_n=8, down_n=16, up_k=2048, down_k=256, up_warps=8, down_warps=8,
                                   down_split=4),
    (128, False, True): DecodeTiles(up_n=32, down_n=32, up_k=1024, down_k=512, up_warps=4, down_warps=4),
    # The down kernel's expert slots split over programs (`down_split`; `bench/moe_decode_tiles.py --split-ab`,
    # one H100, chains of 12 calls over separate weight sets, moe-split-ab-*-h100-s31.json): v4-mini FP8 128×128
    # at one token 16-row blocks over 4 programs, the op 21.8 -> 16.7 µs (down 13.8 -> 8.0); V4-Flash 32×32 at
    # 8 tokens 64-row blocks over 4, 485.1 -> 468.0 µs. No gain at V4-Flash FP8 one token (70.7 vs 72.4 µs
    # split 2; 32×32 78.1 vs 77.4). The same bench on one H200 (thirty-fourth session, moe-split-ab-*-h200-s34.json)
    # took v4-mini bf16 at one token to 8-row blocks over 4 programs: 19.1 -> 17.8 µs there, 22.5 -> 21.9 on
    # the H100 run above (its best, 21.8 at 4-row blocks over 2, is within 0.5 %).
    # V4.1's 32×32 FP8 blocks: each kernel's best shape of `bench/moe_decode_tiles.py --kinds fp8-32 --graph`
    # (moe-decode-tiles-fp8-32-m{1,8}-h200.json), the whole op timed at it in the same run against the 128×128
    # shapes they ran before: V4-Flash 81.5 -> 76.1 µs at one token, 432.5 -> 424.7 at 8; v4-mini 24.8 -> 20.1
    # and 71.7 -> 64.7.
    (32, True, False): DecodeTiles(up_n=16, down_n=8, up_k=1024, down_k=1024, up_warps=4, down_warps=4),
    (32, False, False): DecodeTiles(up_n=32, down_n=64, up_k=1024, down_k=256, up_warps=4, down_warps=4,
                                    down_split=4),
    (32, True, True): DecodeTiles(up_n=4, down_n=4, up_k=512, down_k=512, up_warps=8, down_warps=4),
    (32, False, True): DecodeTiles(up_n=32, down_n=32, up_k=1024, down_k=256, up_warps=4, down_warps=4),
}
_NARROW_DIM = 2048  # widths up to this take the v4-mini-measured shapes

# The gate/up launch streams its weights through TMA where it runs (Hopper), at one shape for every table
# entry but two. On one H100 (thirty-ninth session; CUDA-graph replays, L2 flushed): the kernel alone
# (`bench/moe_decode_tma.py`, moe-decode-tma-h100-s39.json) V4-Flash FP8 128×128 at one token 58.8 -> 52.0 µs,
# 32×32 63.0 -> 52.9, bf16 98.1 -> 87.9; at 8 tokens 295.8 -> 250.5, 373.3 -> 271.4, 598.1 -> 496.3. Issue 6's
# whole op, router included, each with and without, in turn (`--ab`, moe-tma-ab-h100-s39.json, medians of 3):
# V4-Flash FP8 128×128 1.007× / 1.008× at 1 / 8 tokens, 32×32 1.035× / 1.121×, bf16 0.993× / 1.016×; v4-mini
# 1.010× / 0.981×, 1.077× / 1.043×, 1.015× / 1.007×. The two that lost in all three rounds (`_UP_GEMV`) keep
# the GEMV kernel. The v4-mini graph step: 1.010× at 1 request, 1.007× at 8, v41-mini 1.009× at 1
# (moe-up-ab-*-h100-s39.json). The down launch keeps its GEMV kernel (a first TMA down kernel lost at 8
# tokens, moe-decode-tma-h100-s39.json; the split `moe_decode_tma.tma_down` runs it for dense weights at 8
# tokens since the fortieth session, `DOWN_TMA`).
# None: the GEMV kernel everywhere.
UP_TMA: TmaTiles | None = TmaTiles(n=16, k=256, warps=4, stages=5)
_UP_GEMV = {(None, True, False), (128, False, True)}  # V4-Flash bf16 at one token, v4-mini FP8 128×128 at 8
# The down launch through TMA (`moe_decode_tma.tma_down`): table key -> (tiles, programs per row block); keys
# not here keep the GEMV down kernel. On one H100 (fortieth session; `bench/moe_decode_tma.py --down`,
# moe-tma-down-h100-s40.json: the kernel over `DOWN_SWEEP` × 1 / 2 / 4 / 7 programs per row block alone, then
# issue 6's whole op, router included, with the best shape in the tables and without, in turn, 3 rounds) it
# won for dense weights at 8 tokens only: V4-Flash down kernel 335.9 -> 272.7 µs, the op 735.2 -> 713.6 µs
# (1.030×); v4-mini 41.3 -> 39.9 µs, the op 100.8 -> 97.3 (1.036×), every round; the v4-mini graph step at 8
# requests 1.007× / 1.008× in two A/Bs, v41-mini 1.005× (moe-down-ab-*-h100-s40*.json). It lost at one token
# (op 0.92-0.98×) and for FP8 weights (0.83-0.94×).
DOWN_TMA: dict[tuple[int | None, bool, bool], tuple[TmaTiles, int]] = {
    (None, False, False): (TmaTiles(n=8, k=512, warps=4, stages=4), 1),
    (None, False, True): (TmaTiles(n=8, k=512, warps=4, stages=4), 1),
}


# The experts in one launch (`moe_decode_tma.tma_fused`): table key -> (gate/up, down) tiles. On one H100
# (fortieth session; `bench/moe_decode_tma.py --fused`, moe-fused-h100-s40.json: against the shipped two
# launches alone, then issue 6's whole op, router included, with it in `decode_experts`' place and without,
# in turn, 3 rounds) it won at one token on V4-Flash widths for FP8 32×32 weights (the op 89.5 -> 86.3 µs,
# 1.037×) and dense ones (136.0 -> 134.8 µs, 1.010×), every round; it lost at 8 tokens (0.86-0.92×), for
# v4-mini's widths (0.79-0.90×) and at FP8 128×128 (0.997×). Its EARLY form (forty-third session, one H100:
# the counters zeroed before the router, the shared rows' gate/up items streaming while the router runs;
# `bench/moe_decode_tma.py --early`, moe-early-fused-h100-s43.json, read flush, medians of 3 rounds) took the op
# from 78.7 to 73.1 µs at FP8 32×32 (1.078×; the two launches with their early rows: 79.4) and from 126.3 to
# 121.6 at bf16 (1.039×), and won at FP8 128×128 too against the two launches with their early rows (`--fused`,
# moe-fused-early-h100-s43.json: 74.4 -> 72.7 µs, 1.024×, at the down items' 32×256 shape), which it now takes.
FUSED: dict[tuple[int | None, bool, bool], tuple[TmaTiles, TmaTiles]] = {
    (32, True, False): (TmaTiles(n=16, k=256, warps=4, stages=5), TmaTiles(n=32, k=256, warps=4, stages=4)),
    (None, True, False): (TmaTiles(n=16, k=256, warps=4, stages=5), TmaTiles(n=16, k=512, warps=4, stages=3)),
    (128, True, False): (TmaTiles(n=16, k=256, warps=4, stages=5), TmaTiles(n=32, k=256, warps=4, stages=4)),
}


# `decode_experts`' x_ready (the shared expert's gate/up rows started while the router's select kernel runs,
# which releases them before it waits for the logits: `moe_route_decode.RELEASE_FIRST`) applies up to this many
# tokens. On one H100 (forty-first session; `bench/moe_decode_tma.py --early`, moe-early-h100-s41.json: issue 6's
# whole op as shipped, with neither, and with x_ready alone, in turn, 3 rounds) it won at one token wherever the
# TMA gate/up launch runs: V4-Flash FP8 128×128 84.9 -> 80.2 µs (1.058×; 81.2 without the early release),
# v4-mini FP8 128×128 1.046×, 32×32 1.036×, bf16 1.038× (`FUSED`'s cells, one launch, are unchanged). At 8
# tokens, where its grid (shared rows first) is large, it lost 10-12 % (V4-Flash FP8 128×128 0.893×, bf16
# 0.877×; v4-mini bf16 0.895×) and the v4-mini graph step at 8 requests 1/1.066, so it stays off there.
# That grid ran one expert after another; in the usual grid's order (forty-second session, one H100, read
# flush, moe-early-{old,new}-h100-s42.json) the 8-token loss is 3.3 % (405.3 against 391.9 µs; it was 11.1 %
# in the same call with the transposed grid) and one token is unchanged within noise (74.2 against 75.1 µs).
EARLY_MAX_TOKENS = 1


def table_key(n_tok: int, block: int | None, dim: int) -> tuple[int | None, bool, bool]:
    """The decode tables' key: (FP8 scale block kind or None, one token, width D <= 2048)."""
    return None if block is None else 32 if block == 32 else 128, n_tok <= 1, dim <= _NARROW_DIM


def decode_tiles(n_tok: int, block: int | None, dim: int = 4096, top_k: int = 6) -> DecodeTiles:
    """The measured launch shape for `n_tok` tokens with expert weights of width `dim`: dense (`block`
    None) or FP8 with scale blocks of `block` (32: V4.1's own shapes; any other block the 128×128 ones).
    The tables were measured at top-6; a narrower top-k's down kernel splits over at most its K + 1 slots."""
    key = table_key(n_tok, block, dim)
    tiles = _MEASURED[key]._replace(up_tma=None if key in _UP_GEMV else UP_TMA)
    if key in DOWN_TMA:
        tiles = tiles._replace(down_tma=DOWN_TMA[key][0], down_split=DOWN_TMA[key][1])
    if key in FUSED:
        tiles = tiles._replace(fused=FUSED[key])
    return tiles if tiles.down_split <= top_k + 1 else tiles._replace(down_split=top_k + 1)


def _shipped_tiles(x, w1, top_k: int) -> DecodeTiles:
    """`decode_tiles` for x [N, D] and the routed weights w1's kind (dense, or FP8 of its scale block)."""
    _, _, fp8, block = _weight_parts(w1)
    return decode_tiles(x.shape[0], block if fp8 else None, x.shape[1], top_k)


def decode_experts(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, swiglu_limit: float,
                   tiles: DecodeTiles | None = None, x_ready: bool = False, counters=None):
    """`moe.moe_experts` for few assignments: x [N, D] contiguous, weights [N, K] fp32, ids [N, K]
    int32 (checked by the caller); weights dense or FP8. Returns y [N, D] in x.dtype. `tiles`
    default: `decode_tiles` for N and the routed weights' kind. `x_ready`: the caller's promise that
    the launch before this call (the router's) did not write x, nor anything else the shared expert
    reads; at one token (`EARLY_MAX_TOKENS`) the TMA gate/up launch then starts the shared expert's rows
    while that launch still runs (PDL; `moe_decode_tma.tma_up`'s `early`), and so does the one launch
    (`FUSED`) given `counters` (`fused_counters`, made before the router launched), else it starts late."""
    slots = ids.shape[1] + 1
    tiles = _shipped_tiles(x, w1, slots - 1) if tiles is None else tiles
    if not (isinstance(tiles.stages, int) and tiles.stages >= 1):
        raise ValueError(f"DecodeTiles.stages must be an int >= 1, got {tiles.stages!r}")
    if not (isinstance(tiles.down_split, int) and 1 <= tiles.down_split <= slots):
        raise ValueError(f"DecodeTiles.down_split must be an int in 1..{slots} (the shared expert and "
                         f"{slots - 1} routed), got {tiles.down_split!r}")
    if tiles.down_split > 1 and tiles.stages > 1:
        raise ValueError(f"DecodeTiles.down_split {tiles.down_split} takes stages 1, got {tiles.stages}")
    early = x_ready and x.shape[0] <= EARLY_MAX_TOKENS
    if tiles.fused is not None and moe_decode_tma.supported(x, w1, w2, w3, shared_w1, shared_w2, shared_w3):
        return moe_decode_tma.tma_fused(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, swiglu_limit,
                                        *tiles.fused, counters=counters if early else None)
    h, args = decode_up(x, ids, w1, w3, shared_w1, shared_w3, swiglu_limit, tiles, early)
    return decode_down(h, x, weights, ids, w2, shared_w2, args, tiles)


def fused_counters(x, w1, w2, w3, shared_w1, shared_w2, shared_w3, top_k: int):
    """For a `decode_experts` call on x [N, D] with top-k routing and these weights, made before its router
    launches: where the call runs the experts as one launch (`FUSED`) and may start it early (N <=
    `EARLY_MAX_TOKENS`), that launch's counters, zeroed (`moe_decode_tma.fused_counters`; the call's
    `counters`); else None. Zeroing them here, not after the router, keeps a memset out of the PDL chain
    from the router to the experts."""
    if not 1 <= x.shape[0] <= EARLY_MAX_TOKENS:
        return None
    tiles = _shipped_tiles(x, w1, top_k)
    if tiles.fused is None or not moe_decode_tma.supported(x, w1, w2, w3, shared_w1, shared_w2, shared_w3):
        return None
    return moe_decode_tma.fused_counters(x, top_k, tiles.fused[1])


def decode_up(x, ids, w1, w3, shared_w1, shared_w3, swiglu_limit: float, tiles: DecodeTiles = DecodeTiles(),
              early: bool = False):
    """First launch: h [N·K + N, max(I, I_s)] fp32 (routed rows, then each token's shared row), and the
    sizes `decode_down` takes; with `tiles.down_split` > 1 also the split down kernel's ticket counters
    [N, ⌈D/down_n⌉ padded to a power of two] int32, zeroed here (each call's down kernel leaves them 0),
    else None. With `tiles.up_tma`, `moe_decode_tma.tma_up` where it runs (`early`: its EARLY launch, as
    `decode_experts` decides it from `x_ready`)."""
    n_tok, dim = x.shape
    # enough counters for the down launch's row blocks, whichever kernel runs it
    rows = min(tiles.down_n, tiles.down_tma.n) if tiles.down_tma is not None else tiles.down_n
    n_tickets = triton.next_power_of_2(triton.cdiv(dim, rows)) if tiles.down_split > 1 else 0
    operands = moe_decode_tma.up_operands(x, ids, w1, w3, shared_w1, shared_w3, n_tickets)
    (d1, s1, d3, s3, ds1, ss1, ds3, ss3), (fp8, sb, fp8_s, sb_s), h, tickets, args = operands
    if tiles.up_tma is not None and moe_decode_tma.supported(x, d1, d3, ds1, ds3):
        return moe_decode_tma.launch_up(x, ids, operands, swiglu_limit, tiles.up_tma, n_tickets, early)
    n_assign, _, inter, inter_s, h_width, _ = args
    common = _common(ids.shape[1], fp8, sb, fp8_s, sb_s, tiles.up_k, tiles.up_warps, tiles.stages, tiles.up_defer)
    grid = (n_assign + n_tok, triton.cdiv(h_width, tiles.up_n))
    pdl = pdl_launch(x.device, math.prod(grid))
    _decode_up_kernel[grid](
        x, ids, d1, d3, s1, s3, ds1, ds3, ss1, ss3, h, h if tickets is None else tickets, n_assign, dim, inter,
        inter_s, h_width,
        float(swiglu_limit), CLAMP=swiglu_limit > 0, BLOCK_N=tiles.up_n, TICKETS=n_tickets, PDL=pdl,
        launch_pdl=pdl, **common,
    )
    return h, args


def decode_down(h, x, weights, ids, w2, shared_w2, args: tuple, tiles: DecodeTiles = DecodeTiles()):
    """Second launch: y [N, D] in x.dtype from `decode_up`'s h (`args`: its sizes and tickets, made for
    the same `tiles`). With `tiles.down_tma`, `moe_decode_tma.tma_down` where it runs."""
    n_assign, dim, inter, inter_s, h_width, tickets = args
    d2, s2, fp8, sb = _weight_parts(w2)
    ds2, ss2, fp8_s, sb_s = _weight_parts(shared_w2)
    if tiles.down_tma is not None and moe_decode_tma.supported(x, d2, ds2):
        return moe_decode_tma.launch_down(h, x, weights, ids, ((d2, s2, fp8, sb), (ds2, ss2, fp8_s, sb_s)), args,
                                          tiles.down_tma, tiles.down_split)
    split, n_blocks = tiles.down_split, triton.cdiv(dim, tiles.down_n)
    if (split > 1) != (tickets is not None) or (split > 1 and tickets.shape[1] < n_blocks):
        raise ValueError(f"decode_down with down_split {split} needs decode_up's args for the same tiles")
    y, part = moe_decode_tma.down_outputs(x, split)  # tickets: unsplit, the kernel never touches them either
    grid = (x.shape[0], n_blocks, split)
    pdl = pdl_launch(x.device, math.prod(grid))
    _decode_down_kernel[grid](
        h, ids, weights, d2, s2, ds2, ss2, y, part, y if tickets is None else tickets, n_assign, dim, inter,
        inter_s, h_width, 0 if tickets is None else tickets.shape[1], BLOCK_N=tiles.down_n, SPLIT=split, PDL=pdl,
        launch_pdl=pdl,
        **_common(ids.shape[1], fp8, sb, fp8_s, sb_s, tiles.down_k, tiles.down_warps, tiles.stages, tiles.down_defer),
    )
    return y


_MAX_SUB_BLOCKS = 32  # scale blocks per FP8 step: 64 of V4.1's 32-wide blocks spill on sm_90 at 8 warps


def _common(top_k: int, fp8: bool, sb: int, fp8_s: bool, sb_s: int, block_k: int, num_warps: int,
            stages: int, defer: bool) -> dict:
    # FP8 steps: within one scale block, or whole ones (`_gemv_fp8_step`), at most _MAX_SUB_BLOCKS of them
    step, step_s = _block_k(block_k, fp8, sb, _MAX_SUB_BLOCKS), _block_k(block_k, fp8_s, sb_s, _MAX_SUB_BLOCKS)
    kb, kb_s = _sub_blocks(step, fp8, sb), _sub_blocks(step_s, fp8_s, sb_s)
    return dict(TOP_K=top_k, FP8=fp8, SB=sb, FP8_S=fp8_s, SB_S=sb_s, BLOCK_K=step, BLOCK_K_S=step_s,
                STAGES=stages, DEFER=bool(defer), KB=kb, SUB=step // kb, KB_S=kb_s, SUB_S=step_s // kb_s,
                num_warps=num_warps)


def _sub_blocks(step: int, fp8: bool, sb: int) -> int:
    """Sub-blocks of a K step of `_gemv_acc`: the scale blocks it covers (FP8 steps wider than one), else 1."""
    return step // sb if fp8 and step > sb else 1
