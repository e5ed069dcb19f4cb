"""Single-pass mHC of DeepSeek-V4.1 (deepseek_v41 spec §4): the pre site and the post+pre site.

Ops (each `<op>` is Triton, `<op>_ref` is torch, same signature):

* ``mhc_v41_pre(x, pre_in, fn, base, scale, norm_weight, *, rms_eps, hc_eps, sinkhorn_iters, norm_eps)
  -> (pre, post, comb, h)``: the site's own mixes Mix(X) and the sublayer input
  h = RMSNorm(Σ_k pre_in[k] · X_k) collapsed with the *carried* pre of the previous site;
* ``mhc_v41_post_pre(f, x, post, comb, pre_in, fn, base, scale, norm_weight, *, ...)
  -> (y, pre2, post2, comb2, h)``: Y = post ⊗ f + combᵀ X of one site, then `mhc_v41_pre` of the
  next site on Y (the attention -> FFN boundary inside a V4.1 block).

Shape symbols: N tokens, H = n_hc streams, D hidden size, M = (2+H)·H mixes (24 for H = 4).

Why V4.1 fuses better than V4 (`mhc.py`): V4 collapses with the site's own pre, which needs the
full GEMM reduction first, so x is read twice. Here the collapse weights are known before the site
starts, so ONE pass over x (or over Y as it is computed) does everything that reads the streams:

1. `_v41_stats_kernel`, grid (token blocks, K-splits): per tile, the 24-column GEMM x̂·fnᵀ and Σx̂²
   (split-K partials, as `mhc.py`), and the collapse u = Σ_k pre_in[k]·x_k, stored in x.dtype
   (what the unfused path feeds RMSNorm), with its Σu² partial. Each split owns distinct D-blocks,
   so u needs no reduction, only its sum of squares does. Up to `SPLIT_STREAMS_MAX_TOKENS` tokens
   the programs also split the streams, as `mhc._mhc_stats_kernel` (a one-token site otherwise runs
   as few programs as it has D-splits, each a chain of H stream rounds): H programs per split, each
   with one stream's GEMM; the stream-0 one also takes the split's collapse, which needs every stream.
   Under PDL the programs prefetch the site's fn into L2 before they wait, as `mhc.py`'s pass does.
2. `_v41_epilogue_kernel`, grid (token blocks, D-blocks): h = w ⊙ u · rsqrt(Σu²/D + norm_eps) from
   the reduced Σu² (reads u, a quarter of x); the first D-block of each token block also reduces
   the GEMM partials and runs sigmoid + Sinkhorn (`mhc._block_mixes`) and stores pre/post/comb.
   Where the streams split it takes one token per program and reduces every partial in one load
   round (`mhc.split_block`).

Two launches, not one: RMSNorm and Sinkhorn need the full split-K reduction, and a grid-wide
"last program finishes" scheme would need a zeroed counter per call (another launch anyway).
The mixes (pre/post/comb) are needed only after the sublayer, so on the GPU they are off the
critical path exactly as the spec's "statistics overlap" describes; here they simply ride along in
the pass the sublayer input needs anyway, at no extra read of x.

All math is fp32 (TF32 split GEMM as `mhc.py`); y and h are cast to x.dtype. No host sync, buffers
sized from shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dspark.kernels.mhc import (
    _block_mixes, _check_post_args, _check_pre_args, _dot_fp32, _num_sms, _post_stream, _prefetch_fn_share,
    _split_sinkhorn_ref, launch_epilogue_parts, split_block,
)
from dspark.kernels.registry import require_triton

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue, prefetch_launch


def _check_v41_args(x: torch.Tensor, pre_in: torch.Tensor, norm_weight: torch.Tensor) -> None:
    n_tok, n_hc, dim = x.shape
    if tuple(pre_in.shape) != (n_tok, n_hc) or pre_in.dtype != torch.float32:
        raise ValueError(f"pre_in must be float32 [N, n_hc] = [{n_tok}, {n_hc}], "
                         f"got {tuple(pre_in.shape)} {pre_in.dtype}")
    if tuple(norm_weight.shape) != (dim,):
        raise ValueError(f"norm_weight must be [D] = [{dim}], got {tuple(norm_weight.shape)}")


# ----------------------------------------------------------------------------------- references


def _rms_norm_ref(u: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm (deepseek_v4/norm.py), same op order: w ⊙ (u · rsqrt(mean(u²) + eps))."""
    uf = u.float()
    return (weight * (uf * torch.rsqrt(uf.square().mean(-1, keepdim=True) + eps))).to(u.dtype)


def mhc_v41_pre_ref(x: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                    scale: torch.Tensor, norm_weight: torch.Tensor, *, rms_eps: float, hc_eps: float,
                    sinkhorn_iters: int, norm_eps: float, mixes_on=None):
    """V4.1 single-pass mHC pre site (spec §4), in the op order of the model's torch path
    (`stream_mixes`, `split_mixes`, `collapse`, `RMSNorm` of deepseek_v4/{mhc,norm}.py).

    Parameters
    ----------
    x : [N, H, D] bf16 or fp32 -- the streams at the site.
    pre_in : [N, H] fp32 -- the pre carried from the previous site (layer 0: one-hot on stream 0).
    fn : [(2+H)·H, H·D] fp32; base : [(2+H)·H] fp32; scale : [3] fp32 -- the site's mHC parameters.
    norm_weight : [D] fp32 -- the sublayer's RMSNorm weight (attn_norm / ffn_norm).
    rms_eps : eps of the mix statistic; hc_eps : eps of pre/comb and Sinkhorn; sinkhorn_iters :
    column normalisations; norm_eps : eps of the sublayer RMSNorm. mixes_on : where the fused op
    launches the mixes (a context-manager factory, e.g. a side stream's fork); the reference runs
    everything in order and takes it only for the same signature.

    Returns
    -------
    pre, post : [N, H] fp32 (pre is handed to the next site); comb : [N, H, H] fp32;
    h : [N, D] x.dtype = RMSNorm(Σ_k pre_in[k] · x[:, k]).
    """
    n_tok, n_hc, dim = _check_pre_args(x, fn, base, scale, sinkhorn_iters)
    _check_v41_args(x, pre_in, norm_weight)
    xf = x.float().flatten(-2)  # [N, H·D]
    mixes = F.linear(xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + rms_eps), fn)  # [N, M]
    pre, post, comb = _split_sinkhorn_ref(mixes, base, scale, n_hc, hc_eps, sinkhorn_iters)
    u = (pre_in.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)  # [N, D]
    return pre, post, comb, _rms_norm_ref(u, norm_weight, norm_eps)


def mhc_v41_post_pre_ref(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                         pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                         norm_weight: torch.Tensor, *, rms_eps: float, hc_eps: float, sinkhorn_iters: int,
                         norm_eps: float, mixes_on=None):
    """Y = post ⊗ f + combᵀ X (the model's `hc_post` op order), then `mhc_v41_pre_ref` on Y.

    Shape: f [N, D] sublayer output; x [N, H, D]; post [N, H], comb [N, H, H] of the site just run;
    pre_in [N, H] its pre (the carried one for the next site); fn, base, scale, norm_weight of the
    next site. Returns (y [N, H, D] x.dtype, pre2 [N, H], post2 [N, H], comb2 [N, H, H], h [N, D]).
    """
    _check_post_args(f, x, post, comb)
    y = (post.unsqueeze(-1) * f.float().unsqueeze(-2) + torch.einsum("njk,njd->nkd", comb, x.float())).to(x.dtype)
    return (y, *mhc_v41_pre_ref(y, pre_in, fn, base, scale, norm_weight, rms_eps=rms_eps, hc_eps=hc_eps,
                                sinkhorn_iters=sinkhorn_iters, norm_eps=norm_eps))


# --------------------------------------------------------------------------------- Triton kernels


@_jit
def _v41_collapse_tile(x_ptr, x3, f, post_ptr, comb_ptr, xout_ptr, pin_ptr, offs_t, offs_j, offs_d, t_mask, td_mask,
                       dim, HC: tl.constexpr, FUSE_POST: tl.constexpr):
    """u = Σ_k pre_in[k]·x_k [BLOCK_T, BLOCK_D] fp32 over every stream (with FUSE_POST of the rounded
    Y_k, recomputed from x3 [BT, HC_PAD, BD] and f [BT, BD]), summed in stream order as the unsplit
    pass does, so a split pass collapses to the same bits. Unrolled: all streams' loads in flight."""
    u = tl.zeros(td_mask.shape, dtype=tl.float32)
    for k in tl.static_range(HC):
        if FUSE_POST:
            xk = _post_stream(x3, f, post_ptr, comb_ptr, offs_t, offs_j, t_mask, k, HC)
            xk = xk.to(xout_ptr.dtype.element_ty).to(tl.float32)
        else:
            xk = tl.load(x_ptr + offs_t[:, None] * (HC * dim) + k * dim + offs_d[None, :], mask=td_mask,
                         other=0.0).to(tl.float32)
        u += tl.load(pin_ptr + offs_t * HC + k, mask=t_mask, other=0.0)[:, None] * xk
    return u


@_jit
def _v41_stats_kernel(
    x_ptr, f_ptr, post_ptr, comb_ptr, xout_ptr, pin_ptr, fn_ptr, u_ptr, dpart_ptr, sqpart_ptr, uqpart_ptr,
    n_tok, dim, splits, iters,
    HC: tl.constexpr, HC_PAD: tl.constexpr, MIX: tl.constexpr, MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, FUSE_POST: tl.constexpr, X_IS_TF32: tl.constexpr,
    SPLIT_STREAMS: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    """Split-K partials d = x̂·fnᵀ [P, N, MIX_PAD] and Σx̂² [P, N], P = splits (× HC with
    SPLIT_STREAMS), Σu² [splits, N], and u = Σ_k pre_in[k]·x_k [N, D] for the D-blocks split,
    split+splits, ... (`iters` of them). With FUSE_POST the tiles of x are X' = post ⊗ f + combᵀ x,
    stored to xout and used rounded.

    With SPLIT_STREAMS (a few decode tokens) program p takes stream p % HC of split p // HC, as
    `mhc._mhc_stats_kernel`: HC × the programs, each with one stream's GEMM loads in flight. The
    collapse needs every stream of a D-block, so the stream-0 program of each split also takes it
    (`_v41_collapse_tile`: the other streams' x tiles, no fn) and writes that split's Σu² partial.
    With PREFETCH the programs of t-block 0 ask L2 for their share of fn before they wait for the
    predecessor, as `mhc._mhc_stats_kernel`."""
    pid_t = tl.program_id(0)
    pid_p = tl.program_id(1)
    if SPLIT_STREAMS:
        pid_s, k_first = pid_p // HC, pid_p % HC
    else:
        pid_s, k_first = pid_p, 0
    if PREFETCH:
        if pid_t == 0:
            _prefetch_fn_share(fn_ptr, MIX * HC * dim * 4, pid_p, PDL)
    pdl_prologue(PDL)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = offs_t < n_tok
    offs_j = tl.arange(0, HC_PAD)
    offs_m = tl.arange(0, MIX_PAD)
    m_mask = offs_m < MIX
    row = HC * dim
    acc = tl.zeros((BLOCK_T, MIX_PAD), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    uq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for it in range(0, iters):  # fixed trip count, see mhc._mhc_stats_kernel
        offs_d = (pid_s + it * splits) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < dim
        td_mask = t_mask[:, None] & d_mask[None, :]
        x3 = tl.zeros((BLOCK_T, HC_PAD, BLOCK_D), dtype=tl.float32)  # the input streams (FUSE_POST only)
        f = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        if FUSE_POST:
            x3_mask = t_mask[:, None, None] & (offs_j[None, :, None] < HC) & d_mask[None, None, :]
            x3 = tl.load(x_ptr + offs_t[:, None, None] * row + offs_j[None, :, None] * dim
                         + offs_d[None, None, :], mask=x3_mask, other=0.0).to(tl.float32)
            f = tl.load(f_ptr + offs_t[:, None] * dim + offs_d[None, :], mask=td_mask, other=0.0).to(tl.float32)
        u = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for kk in range(1 if SPLIT_STREAMS else HC):
            k = k_first + kk
            tile_off = offs_t[:, None] * row + k * dim + offs_d[None, :]
            if FUSE_POST:
                xk = _post_stream(x3, f, post_ptr, comb_ptr, offs_t, offs_j, t_mask, k, HC)
                xk = xk.to(xout_ptr.dtype.element_ty)
                tl.store(xout_ptr + tile_off, xk, mask=td_mask)
                xk = xk.to(tl.float32)  # the stored (rounded) Y, as the unfused path reads it
            else:
                xk = tl.load(x_ptr + tile_off, mask=td_mask, other=0.0).to(tl.float32)
            sq += tl.sum(xk * xk, axis=1)
            if not SPLIT_STREAMS:
                u += tl.load(pin_ptr + offs_t * HC + k, mask=t_mask, other=0.0)[:, None] * xk
            w = tl.load(fn_ptr + offs_m[:, None] * row + k * dim + offs_d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [MIX_PAD, BD]
            acc = _dot_fp32(xk, w, acc, X_IS_TF32)
        u_mask = td_mask
        if SPLIT_STREAMS:
            # a tensor compare: Triton 3.9's interpreter rejects a mask made with a scalar bool
            u_mask = td_mask & (offs_d[None, :] * 0 + k_first == 0)
            if k_first == 0:
                u = _v41_collapse_tile(x_ptr, x3, f, post_ptr, comb_ptr, xout_ptr, pin_ptr, offs_t, offs_j, offs_d,
                                       t_mask, td_mask, dim, HC, FUSE_POST)
        u = u.to(u_ptr.dtype.element_ty)
        tl.store(u_ptr + offs_t[:, None] * dim + offs_d[None, :], u, mask=u_mask)
        u = u.to(tl.float32)  # RMSNorm sees the rounded collapse, as the unfused path does
        uq += tl.sum(u * u, axis=1)
    part = pid_p * n_tok + offs_t
    tl.store(dpart_ptr + part[:, None] * MIX_PAD + offs_m[None, :], acc, mask=t_mask[:, None])
    tl.store(sqpart_ptr + part, sq, mask=t_mask)
    uq_mask = t_mask
    if SPLIT_STREAMS:
        uq_mask = t_mask & (offs_t * 0 + k_first == 0)
    tl.store(uqpart_ptr + pid_s * n_tok + offs_t, uq, mask=uq_mask)


@_jit
def _sum_partials(part_ptr, offs_t, t_mask, n_tok, n_parts, BLOCK_T: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """Σ over the n_parts rows of a partials buffer [n_parts, N] for tokens `offs_t` [BT] -> [BT] fp32,
    SPLIT_BLOCK rows per load round (one round where SPLIT_BLOCK >= n_parts)."""
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s0 in range(0, n_parts, SPLIT_BLOCK):
        offs_s = s0 + tl.arange(0, SPLIT_BLOCK)
        total += tl.sum(tl.load(part_ptr + offs_s[:, None] * n_tok + offs_t[None, :],
                                mask=(offs_s < n_parts)[:, None] & t_mask[None, :], other=0.0), axis=0)
    return total


@_jit
def _v41_epilogue_kernel(
    u_ptr, w_ptr, h_ptr, dpart_ptr, sqpart_ptr, uqpart_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
    n_tok, dim, n_parts, u_parts, rms_eps, hc_eps, norm_eps, sinkhorn_iters,
    HC: tl.constexpr, HC_PAD: tl.constexpr, MIX_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr, NORM: tl.constexpr, MIXES: tl.constexpr, PDL: tl.constexpr,
):
    """NORM: h tile [BLOCK_T, BLOCK_D] = RMSNorm(u) from the u_parts Σu² partials. MIXES: D-block 0
    reduces the n_parts GEMM / Σx̂² partials (`mhc._block_mixes`: sigmoids, Sinkhorn) and stores
    pre/post/comb of its tokens. Both is the one-launch epilogue; apart, the mixes may run on another
    stream beside the sublayer, which reads h only (`_launch_epilogue`)."""
    pdl_prologue(PDL)
    pid_d = tl.program_id(1)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = offs_t < n_tok
    if NORM:
        uq = _sum_partials(uqpart_ptr, offs_t, t_mask, n_tok, u_parts, BLOCK_T, SPLIT_BLOCK)
        r = tl.rsqrt(uq / dim + norm_eps)  # [BT]
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < dim
        td_mask = t_mask[:, None] & d_mask[None, :]
        u = tl.load(u_ptr + offs_t[:, None] * dim + offs_d[None, :], mask=td_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        h = w[None, :] * (u * r[:, None])
        tl.store(h_ptr + offs_t[:, None] * dim + offs_d[None, :], h.to(h_ptr.dtype.element_ty), mask=td_mask)
    if MIXES:
        if pid_d == 0:
            _, _, tj_mask, pre = _block_mixes(dpart_ptr, sqpart_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, n_tok,
                                              dim, n_parts, rms_eps, hc_eps, sinkhorn_iters, True, HC, HC_PAD,
                                              MIX_PAD, BLOCK_T, SPLIT_BLOCK)
            offs_j = tl.arange(0, HC_PAD)
            tl.store(pre_ptr + offs_t[:, None] * HC + offs_j[None, :], pre, mask=tj_mask)


# ------------------------------------------------------------------------------------ launchers


# Up to this many tokens the statistics pass splits the HC streams over programs too (`_v41_stats_kernel`
# SPLIT_STREAMS) and the epilogue takes one token per program, reducing every partial in one round.
# With the 16-token, 64-wide tiles of `_v41_tiles` the split pays up to 32 tokens (a verify block of 4
# for 8 requests): per site (pre + post_pre mean, D = 2048) 7.6 µs at 8 tokens against 17.2 unsplit (one
# H200, mhc-v41-tiles-h200-s28.json), 7.7 / 9.3 µs at 16 / 32 tokens against 13.3 / 13.6 (one H100,
# `bench/gpu_session29.sh b`, mhc-v41-split-past8-h100-s29.json). bench/mhc_v41_site.py sets 0 to time
# the unsplit pass.
SPLIT_STREAMS_MAX_TOKENS = 32


def _v41_tiles(n_tok: int, fused: bool) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps) of the statistics kernel. As `mhc._stats_tiles` (>= 16 token
    rows for tl.dot; more rows re-read fn from L2 less often), but the collapse keeps one more
    [BT, BD] fp32 tile live, so the tiles are smaller: the largest that compile for sm_90 without
    register spills (checked by tests/kernels/test_compile_sm90.py)."""
    # A split program holds one stream's loads: 16 token rows, a 64-wide D-block at both sites, 4 warps.
    # Per site at 1 / 4 / 8 tokens (one H200, mhc-v41-tiles-h200-s28.json): 7.15 / 7.41 / 7.60 µs,
    # against 10.24 / 12.17 µs with the post_pre site's former 32-wide blocks (twice the programs and
    # the partials its epilogue reduces); 128-wide 8.1-8.7, 2 warps 7.4-8.1. At 32 tokens 32-row
    # tiles ran 10.3 µs against 9.3 (mhc-v41-split-past8-h100-s29.json).
    if n_tok <= SPLIT_STREAMS_MAX_TOKENS:
        return 16, 64, 4
    # Unsplit (past the threshold, or with it at 0 in bench/mhc_v41_site.py): up to 8 tokens 8 warps.
    if n_tok <= 8:
        return 16, 64, 8
    # More tokens (verify blocks of many requests, prefill): 32-token tiles at 4 warps read fn half as
    # often and keep more programs per SM; per site (pre + post_pre mean, D = 2048,
    # `bench/mhc_v41_site.py --tokens 64,256 --unsplit-variants`, mhc-v41-tokens-h200.json) 26.7 -> 14.7 µs
    # at 64 tokens and 91.9 -> 20.5 µs at 256 against the 16-token, 8-warp tiles.
    return (32, 32, 4) if fused else (32, 64, 4)


def _launch_stats(src, pin, fn, fused=None, tiles=None):
    """The statistics pass over `src` [N, H, D] (with `fused` = (f, post, comb, y): over the Y tiles
    computed from src and written to y). Returns (u [N, D] src.dtype, dpart [P, N, MIX_PAD],
    sqpart [P, N], uqpart [S, N]): P = S partials, × H where the streams split. `tiles` overrides
    `_v41_tiles` (bench/mhc_v41_site.py)."""
    n_tok, n_hc, dim = src.shape
    n_mix = fn.shape[0]
    block_t, block_d, warps = tiles or _v41_tiles(n_tok, fused is not None)
    n_tblocks = triton.cdiv(n_tok, block_t)
    n_dblocks = triton.cdiv(dim, block_d)
    split_streams = n_tok <= SPLIT_STREAMS_MAX_TOKENS
    per_split = n_hc if split_streams else 1
    # Split K until the grid covers ~2 waves of SMs: a decode step has one t-block only.
    splits = max(1, min(n_dblocks, triton.cdiv(2 * _num_sms(src.device), n_tblocks * per_split)))
    mix_pad = max(16, triton.next_power_of_2(n_mix))
    dev = src.device
    dpart = torch.empty((splits * per_split, n_tok, mix_pad), device=dev, dtype=torch.float32)
    sqpart = torch.empty((splits * per_split, n_tok), device=dev, dtype=torch.float32)
    uqpart = torch.empty((splits, n_tok), device=dev, dtype=torch.float32)
    u = torch.empty((n_tok, dim), device=dev, dtype=src.dtype)
    f, post_in, comb_in, y = fused if fused is not None else (src, src, src, src)  # unused if not fused
    pdl = pdl_launch(dev, n_tblocks * splits * per_split)
    _v41_stats_kernel[(n_tblocks, splits * per_split)](
        src, f, post_in, comb_in, y, pin, fn, u, dpart, sqpart, uqpart, n_tok, dim, splits,
        triton.cdiv(n_dblocks, splits), HC=n_hc, HC_PAD=triton.next_power_of_2(n_hc), MIX=n_mix, MIX_PAD=mix_pad,
        BLOCK_T=block_t, BLOCK_D=block_d, FUSE_POST=fused is not None, X_IS_TF32=src.dtype != torch.float32,
        SPLIT_STREAMS=split_streams, PREFETCH=prefetch_launch(pdl, fn), PDL=pdl, launch_pdl=pdl, num_warps=warps,
    )
    return u, dpart, sqpart, uqpart


def _launch_epilogue(u, dpart, sqpart, uqpart, base, scale, norm_weight, eps: dict, n_hc: int, mixes_on=None):
    """(pre [N, H], post [N, H], comb [N, H, H] fp32, h [N, D] u.dtype) from the collapse u [N, D] and
    the statistics partials of `_launch_stats`. With `mixes_on` (a context-manager factory, e.g. a
    side stream's fork) h is one launch on the current stream and the mixes another under
    `mixes_on()`: the caller joins that stream before it reads pre, post or comb."""
    n_tok, dim = u.shape
    dev = u.device
    pre = torch.empty((n_tok, n_hc), device=dev, dtype=torch.float32)
    post = torch.empty((n_tok, n_hc), device=dev, dtype=torch.float32)
    comb = torch.empty((n_tok, n_hc, n_hc), device=dev, dtype=torch.float32)
    h = torch.empty((n_tok, dim), device=dev, dtype=u.dtype)
    # one token per program where the statistics split the streams (few tokens, many partials)
    block_t, block_d = (1 if n_tok <= SPLIT_STREAMS_MAX_TOKENS else 4), min(256, triton.next_power_of_2(dim))
    args = (u, norm_weight, h, dpart, sqpart, uqpart, base, scale, pre, post, comb, n_tok, dim, dpart.shape[0],
            uqpart.shape[0], float(eps["rms_eps"]), float(eps["hc_eps"]), float(eps["norm_eps"]),
            int(eps["sinkhorn_iters"]))
    consts = dict(HC=n_hc, HC_PAD=triton.next_power_of_2(n_hc), MIX_PAD=dpart.shape[2], BLOCK_T=block_t,
                  BLOCK_D=block_d, SPLIT_BLOCK=split_block(dpart.shape[0], block_t))

    def launch(d_blocks: int, norm: bool, mixes: bool) -> None:
        grid = (triton.cdiv(n_tok, block_t), d_blocks)
        pdl = pdl_launch(dev, math.prod(grid))
        _v41_epilogue_kernel[grid](*args, **consts, NORM=norm, MIXES=mixes, PDL=pdl, launch_pdl=pdl)

    n_dblocks = triton.cdiv(dim, block_d)
    launch_epilogue_parts(mixes_on, lambda: launch(n_dblocks, True, True), lambda: launch(1, False, True),
                          lambda: launch(n_dblocks, True, False), dpart, sqpart)
    return pre, post, comb, h


def _launch(src, pin, fn, base, scale, norm_weight, eps: dict, fused=None, mixes_on=None):
    """Both launches over `src` [N, H, D] (or, with `fused` = (f, post, comb, y), over the Y tiles
    computed from src and written to y). Returns (pre, post, comb, h)."""
    u, dpart, sqpart, uqpart = _launch_stats(src, pin, fn, fused)
    return _launch_epilogue(u, dpart, sqpart, uqpart, base, scale, norm_weight, eps, src.shape[1], mixes_on)


def mhc_v41_pre(x: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                scale: torch.Tensor, norm_weight: torch.Tensor, *, rms_eps: float, hc_eps: float,
                sinkhorn_iters: int, norm_eps: float, mixes_on=None):
    """Fused `mhc_v41_pre_ref` (same signature, shapes and dtypes): one pass over x + epilogue (with
    `mixes_on`, the mixes launched under it: `_launch_epilogue`)."""
    require_triton()
    _check_pre_args(x, fn, base, scale, sinkhorn_iters)
    _check_v41_args(x, pre_in, norm_weight)
    eps = dict(rms_eps=rms_eps, hc_eps=hc_eps, norm_eps=norm_eps, sinkhorn_iters=sinkhorn_iters)
    return _launch(x.contiguous(), pre_in.contiguous(), fn.contiguous(), base.contiguous(), scale.contiguous(),
                   norm_weight.contiguous(), eps, mixes_on=mixes_on)


def mhc_v41_post_pre(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     norm_weight: torch.Tensor, *, rms_eps: float, hc_eps: float, sinkhorn_iters: int,
                     norm_eps: float, mixes_on=None):
    """Fused `mhc_v41_post_pre_ref`: Y written, and its statistics and collapse taken, in one pass
    (`mixes_on` as `mhc_v41_pre`'s)."""
    require_triton()
    _check_post_args(f, x, post, comb)
    _check_pre_args(x, fn, base, scale, sinkhorn_iters)
    _check_v41_args(x, pre_in, norm_weight)
    x = x.contiguous()
    y = torch.empty_like(x)
    fused = (f.contiguous(), post.float().contiguous(), comb.float().contiguous(), y)
    eps = dict(rms_eps=rms_eps, hc_eps=hc_eps, norm_eps=norm_eps, sinkhorn_iters=sinkhorn_iters)
    return (y, *_launch(x, pre_in.contiguous(), fn.contiguous(), base.contiguous(), scale.contiguous(),
                        norm_weight.contiguous(), eps, fused=fused, mixes_on=mixes_on))
