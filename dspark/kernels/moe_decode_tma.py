"""Decode-sized MoE experts with the weights streamed by the Tensor Memory Accelerator (Hopper TMA).

`moe_decode`'s GEMV kernels load each weight tile into registers with ordinary loads; on the H200 they
are latency-bound at one token (Nsight Compute: issue slots half idle, 50–66 % of DRAM bandwidth), as
each warp can keep only a few loads in flight. Here the same two launches read the weight tiles
through TMA descriptors in a software-pipelined loop: Triton allocates STAGES − 1 shared-memory
buffers per program and issues the copies for the next steps while this one is summed, so each SM
holds tens of KB of weights in flight at little register cost.

Same computation and outputs as `moe_decode.decode_up` / `decode_down` (h [N·K + N, max(I, I_s)]
fp32, then y [N, D] in x.dtype), with different fp32 summation orders:

1. `_tma_up_kernel`, grid (N·K + N, ⌈I/BLOCK_N⌉): work row a (routed assignment, then each token's
   shared expert) times its gate and up weights' rows n0 .. n0 + BLOCK_N, clamped SwiGLU.
2. `_tma_down_kernel`, grid (N, ⌈D/BLOCK_N⌉): the K routed slots' steps in one flat pipelined loop
   (the routing weight folded into h), then the shared expert's, one cast at the end.

FP8 weights (`FP8BlockWeight`): each program's rows lie in one scale row (BLOCK_N divides the block),
so the UE8M0 factor of each column (a power of two, exact) multiplies the activations instead of the
weights. The accumulators are [BLOCK_N, BLOCK_K] fp32, summed over columns once at the end.

Descriptors are made on the host per call (`triton.tools.tensor_descriptor.TensorDescriptor`); no
host sync, CUDA-graph capturable (the weights do not move).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dspark.kernels.moe import _clamped_swiglu, _jit, _weight_parts, tl, triton
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue


class TmaTiles(NamedTuple):
    """Output rows per program, reduction step (columns per TMA tile), warps and pipeline depth of
    each kernel."""

    up_n: int = 16
    up_k: int = 256
    up_warps: int = 4
    down_n: int = 16
    down_k: int = 256
    down_warps: int = 4
    stages: int = 4


@_jit
def _scaled(v, s_ptr, e, n0, k0, n_out, n_in, FP8: tl.constexpr, SB: tl.constexpr, BLOCK_K: tl.constexpr):
    """v [BLOCK_K] fp32 times each column's UE8M0 factor of scale row n0 // SB of expert e (FP8), else v."""
    if FP8:
        cols = k0 + tl.arange(0, BLOCK_K)
        s_cols = tl.cdiv(n_in, SB)
        byte = tl.load(s_ptr + (e * tl.cdiv(n_out, SB) + n0 // SB) * s_cols + cols // SB, mask=cols < n_in,
                       other=127)
        v = v * (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127), exact
    return v


@_jit
def _swiglu_tma(x_row_ptr, g_desc, u_desc, sg_ptr, su_ptr, e, n0, n_out, dim, limit, FP8: tl.constexpr,
                SB: tl.constexpr, CLAMP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                STAGES: tl.constexpr):
    """Clamped SwiGLU of one token's row for rows n0 .. n0 + BLOCK_N of expert e: fp32 [BLOCK_N]."""
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, dim, BLOCK_K, num_stages=STAGES):
        g = g_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K)
        u = u_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
        acc_g += g.to(tl.float32) * _scaled(x, sg_ptr, e, n0, k0, n_out, dim, FP8, SB, BLOCK_K)[None, :]
        acc_u += u.to(tl.float32) * _scaled(x, su_ptr, e, n0, k0, n_out, dim, FP8, SB, BLOCK_K)[None, :]
    return _clamped_swiglu(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), limit, CLAMP)


@_jit
def _tma_up_kernel(x_ptr, ids_ptr, g_desc, u_desc, sg_ptr, su_ptr, sg_s_desc, su_s_desc, sgs_ptr, sus_ptr, h_ptr,
                   n_assign, dim, inter, inter_s, h_width, limit, TOP_K: tl.constexpr, FP8: tl.constexpr,
                   SB: tl.constexpr, FP8_S: tl.constexpr, SB_S: tl.constexpr, CLAMP: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """h[a, n0 : n0 + BLOCK_N] for work row a: routed assignment a < N·K, else token a − N·K's shared expert."""
    pdl_prologue(PDL)
    a = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    if a < n_assign:
        e = tl.load(ids_ptr + a)
        h = _swiglu_tma(x_ptr + (a // TOP_K).to(tl.int64) * dim, g_desc, u_desc, sg_ptr, su_ptr, e, n0, inter, dim,
                        limit, FP8, SB, CLAMP, BLOCK_N, BLOCK_K, STAGES)
        n_out = inter
    else:
        h = _swiglu_tma(x_ptr + (a - n_assign).to(tl.int64) * dim, sg_s_desc, su_s_desc, sgs_ptr, sus_ptr, 0, n0,
                        inter_s, dim, limit, FP8_S, SB_S, CLAMP, BLOCK_N, BLOCK_K, STAGES)
        n_out = inter_s
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + a.to(tl.int64) * h_width + offs_n, h, mask=offs_n < n_out)


@_jit
def _tma_down_kernel(h_ptr, ids_ptr, wts_ptr, d_desc, s_ptr, ds_desc, ss_ptr, y_ptr, dim, inter, inter_s, h_width,
                     n_assign, TOP_K: tl.constexpr, K_PAD: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr,
                     FP8_S: tl.constexpr, SB_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr, PDL: tl.constexpr):
    """y[t, n0 : n0 + BLOCK_N] = Σ_k w[t, k] · h[t·K + k] · W2[ids[t, k]]ᵀ + h[shared t] · W2_sᵀ."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    slot = tl.arange(0, K_PAD)
    ids = tl.load(ids_ptr + t * TOP_K + slot, mask=slot < TOP_K, other=0)  # [K_PAD]: no load inside the loop
    wts = tl.load(wts_ptr + t * TOP_K + slot, mask=slot < TOP_K, other=0.0)
    n_steps = tl.cdiv(inter, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in tl.range(0, TOP_K * n_steps, num_stages=STAGES):  # the routed slots' steps, one flat loop
        k = i // n_steps
        k0 = (i - k * n_steps) * BLOCK_K
        e = tl.sum(tl.where(slot == k, ids, 0))
        w = d_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        hv = tl.load(h_ptr + (t * TOP_K + k) * h_width + cols, mask=cols < inter, other=0.0)
        hv = _scaled(hv * tl.sum(tl.where(slot == k, wts, 0.0)), s_ptr, e, n0, k0, dim, inter, FP8, SB, BLOCK_K)
        acc += w.to(tl.float32) * hv[None, :]
    for k0 in tl.range(0, inter_s, BLOCK_K, num_stages=STAGES):  # the shared expert
        w = ds_desc.load([0, n0, k0]).reshape(BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        hv = tl.load(h_ptr + (n_assign + t) * h_width + cols, mask=cols < inter_s, other=0.0)
        acc += w.to(tl.float32) * _scaled(hv, ss_ptr, 0, n0, k0, dim, inter_s, FP8_S, SB_S, BLOCK_K)[None, :]
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + t * dim + offs_n, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=offs_n < dim)


def _descriptor(data: torch.Tensor, block_n: int, block_k: int):
    """A TMA descriptor over expert weights [E, out, in] (or one expert's [out, in]) with tiles [1, BN, BK]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    data = data if data.dim() == 3 else data.unsqueeze(0)
    return TensorDescriptor.from_tensor(data, [1, block_n, block_k])


def _check_tiles(block_n: int, block_k: int, blocks: tuple) -> None:
    if block_n & (block_n - 1) or block_k & (block_k - 1) or block_k < 16:
        raise ValueError(f"TmaTiles rows and steps must be powers of two (steps >= 16), got {block_n}, {block_k}")
    for sb in blocks:
        if sb and (sb % block_n or block_k % sb and sb % block_k):
            raise ValueError(f"TmaTiles rows {block_n} must divide the FP8 block {sb}, and steps {block_k} "
                             f"be a multiple or divisor of it")


def tma_up(x, ids, w1, w3, shared_w1, shared_w3, swiglu_limit: float, tiles: TmaTiles = TmaTiles()):
    """`moe_decode.decode_up` (without the split down kernel's tickets) through TMA: (h, sizes)."""
    n_tok, dim = x.shape
    top_k = ids.shape[1]
    n_assign = n_tok * top_k
    d1, s1, fp8, sb = _weight_parts(w1)
    d3, s3, _, _ = _weight_parts(w3)
    ds1, ss1, fp8_s, sb_s = _weight_parts(shared_w1)
    ds3, ss3, _, _ = _weight_parts(shared_w3)
    _check_tiles(tiles.up_n, tiles.up_k, (sb if fp8 else 0, sb_s if fp8_s else 0))
    inter, inter_s = d1.shape[1], ds1.shape[0]
    h_width = max(inter, inter_s)
    h = torch.empty((n_assign + n_tok, h_width), dtype=torch.float32, device=x.device)
    grid = (n_assign + n_tok, triton.cdiv(h_width, tiles.up_n))
    pdl = pdl_launch(x.device, math.prod(grid))
    descs = [_descriptor(d, tiles.up_n, tiles.up_k) for d in (d1, d3, ds1, ds3)]
    _tma_up_kernel[grid](
        x, ids, descs[0], descs[1], s1, s3, descs[2], descs[3], ss1, ss3, h, n_assign, dim, inter, inter_s, h_width,
        float(swiglu_limit), TOP_K=top_k, FP8=fp8, SB=sb, FP8_S=fp8_s, SB_S=sb_s, CLAMP=swiglu_limit > 0,
        BLOCK_N=tiles.up_n, BLOCK_K=tiles.up_k, STAGES=tiles.stages, PDL=pdl, launch_pdl=pdl,
        num_warps=tiles.up_warps,
    )
    return h, (n_assign, dim, inter, inter_s, h_width)


def tma_down(h, x, weights, ids, w2, shared_w2, sizes: tuple, tiles: TmaTiles = TmaTiles()):
    """`moe_decode.decode_down` through TMA: y [N, D] in x.dtype from `tma_up`'s h and sizes."""
    n_assign, dim, inter, inter_s, h_width = sizes
    d2, s2, fp8, sb = _weight_parts(w2)
    ds2, ss2, fp8_s, sb_s = _weight_parts(shared_w2)
    _check_tiles(tiles.down_n, tiles.down_k, (sb if fp8 else 0, sb_s if fp8_s else 0))
    y = torch.empty_like(x)
    top_k = ids.shape[1]
    grid = (x.shape[0], triton.cdiv(dim, tiles.down_n))
    pdl = pdl_launch(x.device, math.prod(grid))
    _tma_down_kernel[grid](
        h, ids, weights, _descriptor(d2, tiles.down_n, tiles.down_k), s2,
        _descriptor(ds2, tiles.down_n, tiles.down_k), ss2, y, dim, inter, inter_s, h_width, n_assign,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), FP8=fp8, SB=sb, FP8_S=fp8_s, SB_S=sb_s,
        BLOCK_N=tiles.down_n, BLOCK_K=tiles.down_k, STAGES=tiles.stages, PDL=pdl, launch_pdl=pdl,
        num_warps=tiles.down_warps,
    )
    return y


def tma_experts(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, swiglu_limit: float,
                tiles: TmaTiles = TmaTiles()):
    """`moe_decode.decode_experts` through TMA: y [N, D] in x.dtype."""
    h, sizes = tma_up(x, ids, w1, w3, shared_w1, shared_w3, swiglu_limit, tiles)
    return tma_down(h, x, weights, ids, w2, shared_w2, sizes, tiles)
