"""Manifold-constrained hyper-connections (mHC, deepseek_v4 spec §6): pre, post, and post+pre fused.

Ops (each `<op>` is Triton, `<op>_ref` is torch, same signature):

* ``mhc_pre(x, fn, base, scale, *, rms_eps, hc_eps, sinkhorn_iters) -> (post, comb, u)`` (§6.2)
* ``mhc_post(f, x, post, comb) -> x_new``  with ``X' = post ⊗ f + combᵀ X`` (§6.3)
* ``mhc_post_pre(f, x, post, comb, fn, base, scale, *, ...) -> (x_new, post2, comb2, u2)``: the post
  of one site followed by the pre of the next (§6.5 overlap).

Shape symbols: N tokens, H = n_hc streams, D hidden size, M = (2+H)·H mixes (24 for H = 4).

Fused pre, two launches:

1. *statistics* (`_mhc_stats_kernel`): ONE pass over the flattened state x̂ [N, H·D] computes the
   24-column mixing GEMM d = x̂·fnᵀ and the RMS statistic s = Σx̂² together (the norm is unweighted,
   so it commutes with the GEMM, spec §6.5). The pass is split over K (D-blocks) so that decode-sized
   N still fills the GPU; partials go to [splits, N, M] and [splits, N].
2. *epilogue* (`_mhc_epilogue_kernel`): reduces the partials, μ = d·rsqrt(s/(H·D) + rms_eps), the
   sigmoids, softmax and Sinkhorn (exact order of §6.2 step 8), then the collapse u = Σ_k pre_k x_k.
   The collapse needs `pre`, which needs the full reduction: that second read of x cannot be fused
   into the first without a grid-wide barrier.

Two launches at decode sizes too. One launch was tried (commit 4bc4ef7: every statistics program
takes an atomic ticket after its partials, the last one runs the epilogue) and was slower on one
H200 (`bench/mhc_decode_site.py`, CUDA graph of 24 sites, D = 2048, bf16): 15.7 vs 14.9 µs per site
at N = 1, 29.7 vs 15.3 at N = 8. It saves a launch gap but pays the ticket and a zeroed counter per
call (a 0.9 µs fill: the library keeps no state to reset one), and one program then runs the whole
epilogue chain -- partials, 20 Sinkhorn steps, the collapse over all of D -- that the second launch
spreads over many programs.

`mhc_post_pre` runs the statistics kernel with the post fused into its prologue: it computes each
X' tile from (f, x, post, comb), stores it, and accumulates the next site's GEMM and Σx'² from the
stored (rounded) values, so X' is never re-read for the statistics.

All math is fp32: the GEMM runs on TF32 tensor cores with fn split into two TF32 halves (bf16 x is
exactly TF32, so two passes give ≈ fp32 accuracy; fp32 x takes three); u and X' are cast to x.dtype.
CUDA-graph capturable: no host sync, buffers sized from shapes only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dspark.kernels.registry import require_triton

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prefetch, pdl_prologue, prefetch_launch


# --------------------------------------------------------------------------------------- checks


def _check_pre_args(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    sinkhorn_iters: int) -> tuple[int, int, int]:
    """Validate mhc_pre shapes; return (N, H, D)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [N, n_hc, D], got shape {tuple(x.shape)}")
    n_tok, n_hc, dim = x.shape
    n_mix = (2 + n_hc) * n_hc
    if tuple(fn.shape) != (n_mix, n_hc * dim):
        raise ValueError(f"fn must be [(2+n_hc)*n_hc, n_hc*D] = [{n_mix}, {n_hc * dim}], got {tuple(fn.shape)}")
    if tuple(base.shape) != (n_mix,):
        raise ValueError(f"base must be [(2+n_hc)*n_hc] = [{n_mix}], got {tuple(base.shape)}")
    if tuple(scale.shape) != (3,):
        raise ValueError(f"scale must be [3], got {tuple(scale.shape)}")
    for name, t in (("fn", fn), ("base", base), ("scale", scale)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (mHC parameters stay fp32), got {t.dtype}")
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    return n_tok, n_hc, dim


def _check_post_args(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [N, n_hc, D], got shape {tuple(x.shape)}")
    n_tok, n_hc, dim = x.shape
    if tuple(f.shape) != (n_tok, dim):
        raise ValueError(f"f must be [N, D] = [{n_tok}, {dim}], got {tuple(f.shape)}")
    if tuple(post.shape) != (n_tok, n_hc):
        raise ValueError(f"post must be [N, n_hc] = [{n_tok}, {n_hc}], got {tuple(post.shape)}")
    if tuple(comb.shape) != (n_tok, n_hc, n_hc):
        raise ValueError(f"comb must be [N, n_hc, n_hc] = [{n_tok}, {n_hc}, {n_hc}], got {tuple(comb.shape)}")


# ----------------------------------------------------------------------------------- references


def _split_sinkhorn_ref(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n_hc: int,
                        hc_eps: float, sinkhorn_iters: int):
    """mix [N, M] fp32 (already multiplied by ρ) -> pre [N, H], post [N, H], comb [N, H, H] (§6.2 4-8)."""
    pre_mix, post_mix, comb_mix = mix.split([n_hc, n_hc, n_hc * n_hc], dim=-1)
    pre = torch.sigmoid(pre_mix * scale[0] + base[:n_hc]) + hc_eps
    post = 2.0 * torch.sigmoid(post_mix * scale[1] + base[n_hc:2 * n_hc])
    logits = (comb_mix * scale[2] + base[2 * n_hc:]).view(-1, n_hc, n_hc)  # [N, j, k] row-major
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)  # the first step is a column norm
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def mhc_pre_ref(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                rms_eps: float, hc_eps: float, sinkhorn_iters: int, mixes_on=None):
    """mHC pre (spec §6.2): mixing weights of one site and the collapsed sublayer input.

    Parameters
    ----------
    x : [N, H, D] bf16 or fp32 -- the H residual streams of N tokens.
    fn : [(2+H)·H, H·D] fp32; base : [(2+H)·H] fp32; scale : [3] fp32 -- the site's parameters.
    rms_eps : eps of the RMS statistic (rms_norm_eps); hc_eps : eps of pre/comb and Sinkhorn;
    sinkhorn_iters : column normalisations (row normalisations are one fewer).
    mixes_on : where the fused op launches post and comb (`_launch_epilogue`); the reference runs in
    order and takes it only for the same signature.

    Returns
    -------
    post : [N, H] fp32 in (0, 2); comb : [N, H, H] fp32, columns sum to 1; u : [N, D] x.dtype,
    u = Σ_k pre_k · x[:, k].
    """
    _, n_hc, _ = _check_pre_args(x, fn, base, scale, sinkhorn_iters)
    xf = x.float().flatten(-2)  # [N, H·D]
    # Normalise, then the GEMM: the op order of the model's torch path (deepseek_v4/mhc.py
    # `hc_pre`), so the model wired through this reference computes exactly what it did without it.
    mix = F.linear(xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + rms_eps), fn)  # [N, M]
    pre, post, comb = _split_sinkhorn_ref(mix, base, scale, n_hc, hc_eps, sinkhorn_iters)
    u = (pre.unsqueeze(-1) * x.float()).sum(dim=-2)  # [N, D]
    return post, comb, u.to(x.dtype)


def mhc_post_ref(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC post (spec §6.3): X'[:, k] = post_k · f + Σ_j comb[j, k] · X[:, j], fp32 math.

    Shape: f [N, D] (sublayer output), x [N, H, D], post [N, H], comb [N, H, H] -> X' [N, H, D] x.dtype.
    """
    _check_post_args(f, x, post, comb)
    # The op order of the model's `hc_post` (deepseek_v4/mhc.py), bit for bit.
    mixed = torch.einsum("njk,njd->nkd", comb.float(), x.float())  # [N, k, D]: sums over comb's FIRST index
    return (post.float().unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(x.dtype)


def mhc_post_pre_ref(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                     rms_eps: float, hc_eps: float, sinkhorn_iters: int, mixes_on=None):
    """mhc_post of one site, then mhc_pre of the next site on its output (spec §6.5).

    Shape: f [N, D], x [N, H, D], post [N, H], comb [N, H, H] (previous site); fn, base, scale of the
    next site and `mixes_on` as in `mhc_pre_ref`. Returns (x_new [N, H, D] x.dtype, post2 [N, H], comb2 [N, H, H],
    u2 [N, D] x.dtype).
    """
    x_new = mhc_post_ref(f, x, post, comb)
    post2, comb2, u2 = mhc_pre_ref(x_new, fn, base, scale, rms_eps=rms_eps, hc_eps=hc_eps,
                                   sinkhorn_iters=sinkhorn_iters)
    return x_new, post2, comb2, u2


# --------------------------------------------------------------------------------- Triton kernels


@_jit
def _post_stream(x3, f, post_ptr, comb_ptr, offs_t, offs_j, t_mask, k, HC: tl.constexpr):
    """Stream k of X' = post ⊗ f + combᵀ X for a [BLOCK_T, BLOCK_D] tile, fp32.

    x3 [BLOCK_T, HC_PAD, BLOCK_D] fp32 (all input streams of the tile), f [BLOCK_T, BLOCK_D] fp32.
    """
    post_k = tl.load(post_ptr + offs_t * HC + k, mask=t_mask, other=0.0)  # [BT]
    j_mask = t_mask[:, None] & (offs_j[None, :] < HC)
    comb_col = tl.load(comb_ptr + offs_t[:, None] * (HC * HC) + offs_j[None, :] * HC + k,
                       mask=j_mask, other=0.0)  # [BT, HC_PAD]: comb[t, j, k]
    return post_k[:, None] * f + tl.sum(comb_col[:, :, None] * x3, axis=1)


@_jit
def _dot_fp32(x, w, acc, X_IS_TF32: tl.constexpr):
    """acc + x·wᵀ at ≈ fp32 accuracy on TF32 tensor cores: w = w_hi + w_lo (both TF32) and, unless
    x is exactly TF32 already (bf16/fp16 data is), x likewise; the lo·lo term (< 2^-22) is dropped."""
    w_hi = (w.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)  # keep 10 mantissa bits
    w_lo = w - w_hi
    if X_IS_TF32:
        acc = tl.dot(x, tl.trans(w_hi), acc, input_precision="tf32")
        acc = tl.dot(x, tl.trans(w_lo), acc, input_precision="tf32")
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32x3")
    return acc


@_jit
def _prefetch_fn_share(fn_ptr, fn_bytes, pid_p, PDL: tl.constexpr):
    """Before `pdl_prologue`: program `pid_p` of the statistics grid's axis 1 asks L2 for its share of
    the site's fp32 fn (`fn_bytes` bytes, shares of 16-byte multiples, see `pdl_prefetch`)."""
    share = tl.cdiv(tl.cdiv(fn_bytes, tl.num_programs(1)), 16) * 16
    start = pid_p * share
    pdl_prefetch(fn_ptr + start // 4, tl.maximum(tl.minimum(share, fn_bytes - start), 0), PDL)


@_jit
def _mhc_stats_kernel(
    x_ptr, f_ptr, post_ptr, comb_ptr, xout_ptr, fn_ptr, dpart_ptr, sqpart_ptr,
    n_tok, dim, splits, iters,
    HC: tl.constexpr, HC_PAD: tl.constexpr, MIX: tl.constexpr, MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, FUSE_POST: tl.constexpr, X_IS_TF32: tl.constexpr,
    SPLIT_STREAMS: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    """Split-K partials of d = x̂·fnᵀ [P, N, MIX_PAD] and s = Σx̂² [P, N], P = splits (× HC with
    SPLIT_STREAMS).

    Program (t-block, split) walks D-blocks split, split+splits, ... (`iters` of them); per D-block
    it handles all HC streams, so with FUSE_POST the inputs of X' (all streams of x) load once per tile.
    With SPLIT_STREAMS (a few decode tokens) program p takes stream p % HC of split p // HC: 4× the
    programs, each with one stream's loads in flight instead of a chain of HC dependent rounds.
    With PREFETCH the programs of t-block 0 ask L2 for fn before they wait for the predecessor (split s
    for the s-th share of its bytes: the site's fp32 weights, 0.8 MB at D = 2048, stream in meanwhile).
    """
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
    row = HC * dim  # elements per token of x, X' and a row of fn
    acc = tl.zeros((BLOCK_T, MIX_PAD), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    # A fixed trip count (not range(pid_s, n_dblocks, splits)): the Triton interpreter cannot loop
    # over program-id-dependent bounds. A D-block past the end is fully masked by d_mask.
    for it in range(0, iters):
        offs_d = (pid_s + it * splits) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < dim
        td_mask = t_mask[:, None] & d_mask[None, :]
        if FUSE_POST:
            x3_mask = t_mask[:, None, None] & (offs_j[None, :, None] < HC) & d_mask[None, None, :]
            x3 = tl.load(x_ptr + offs_t[:, None, None] * row + offs_j[None, :, None] * dim
                         + offs_d[None, None, :], mask=x3_mask, other=0.0).to(tl.float32)
            f = tl.load(f_ptr + offs_t[:, None] * dim + offs_d[None, :], mask=td_mask, other=0.0).to(tl.float32)
        for kk in range(1 if SPLIT_STREAMS else HC):  # a loop, not static_range: unrolled, the 4 streams' tiles spilled
            k = k_first + kk
            tile_off = offs_t[:, None] * row + k * dim + offs_d[None, :]
            if FUSE_POST:
                xk = _post_stream(x3, f, post_ptr, comb_ptr, offs_t, offs_j, t_mask, k, HC)
                xk = xk.to(xout_ptr.dtype.element_ty)
                tl.store(xout_ptr + tile_off, xk, mask=td_mask)
                xk = xk.to(tl.float32)  # statistics of the stored (rounded) X', as an unfused pre sees it
            else:
                xk = tl.load(x_ptr + tile_off, mask=td_mask, other=0.0).to(tl.float32)
            sq += tl.sum(xk * xk, axis=1)
            w = tl.load(fn_ptr + offs_m[:, None] * row + k * dim + offs_d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [MIX_PAD, BD]
            acc = _dot_fp32(xk, w, acc, X_IS_TF32)
    part = pid_p * n_tok + offs_t
    tl.store(dpart_ptr + part[:, None] * MIX_PAD + offs_m[None, :], acc, mask=t_mask[:, None])
    tl.store(sqpart_ptr + part, sq, mask=t_mask)


@_jit
def _sinkhorn(logits, valid, hc_eps, sinkhorn_iters):
    """Row softmax + hc_eps, one column norm, then (iters-1) × (row norm, column norm).

    logits, valid: [BT, HC_PAD (j), HC_PAD (k)]; padded entries stay exactly 0.

    Each thread holds the whole 4 × 4 matrix (the compiler replicates it), so the sums are register
    adds; the cost is instructions. `a / b` is PTX div.full.f32, which ptxas expands per ELEMENT into
    range checks, two predicated rescales of a and b, then a · rcp(b). So each normalisation takes one
    reciprocal per row or column and multiplies: for a divisor in [2^-126, 2^126] -- every sum + hc_eps
    here -- div.full is exactly a · rcp(b), so the bits are those of the division with ~half the
    instructions (the loop is the epilogue's longest dependent chain).
    """
    logits = tl.where(valid, logits, -1.0e30)  # finite: padded rows must not produce inf - inf
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    # tl.fma(a, r, 0.0), not a * r: a plain product would be contracted into the next sum's adds
    # (an FFMA, one rounding fewer), changing the bits; a·r + 0 rounds as the product (values >= 0).
    comb = tl.fma(e, (1.0 / tl.sum(e, axis=2))[:, :, None], 0.0)
    comb = tl.where(valid, comb + hc_eps, 0.0)
    comb = tl.fma(comb, (1.0 / (tl.sum(comb, axis=1) + hc_eps))[:, None, :], 0.0)
    for _ in range(sinkhorn_iters - 1):
        comb = tl.fma(comb, (1.0 / (tl.sum(comb, axis=2) + hc_eps))[:, :, None], 0.0)
        comb = tl.fma(comb, (1.0 / (tl.sum(comb, axis=1) + hc_eps))[:, None, :], 0.0)
    return comb


@_jit
def _site_params(base_ptr, scale_ptr, HC: tl.constexpr, HC_PAD: tl.constexpr):
    """A site's (scale_pre, scale_post, scale_comb) scalars and base of pre [HC_PAD], post [HC_PAD],
    comb [HC_PAD (j), HC_PAD (k)], 0 on padding. Kernels load them before the partials' reductions:
    a load placed after a reduction waits for its barrier, one more memory round trip."""
    offs_j = tl.arange(0, HC_PAD)
    j_ok = offs_j < HC
    jk = 2 * HC + offs_j[:, None] * HC + offs_j[None, :]  # [j, k] offset of comb in the mix vector
    return (tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2),
            tl.load(base_ptr + offs_j, mask=j_ok, other=0.0), tl.load(base_ptr + HC + offs_j, mask=j_ok, other=0.0),
            tl.load(base_ptr + jk, mask=j_ok[:, None] & j_ok[None, :], other=0.0))


@_jit
def _partial_sums(dpart_ptr, sqpart_ptr, offs_t, t_mask, n_tok, splits,
                  HC: tl.constexpr, HC_PAD: tl.constexpr, MIX_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                  SPLIT_BLOCK: tl.constexpr, PRE: tl.constexpr, MIXES: tl.constexpr):
    """The statistics partials of tokens `offs_t` [BT] summed: (sq [BT], pre_mix [BT, HC_PAD] (zeros
    unless PRE), post_mix [BT, HC_PAD], comb_mix [BT, HC_PAD, HC_PAD] (zeros unless MIXES)).

    SPLIT_BLOCK partials per step (decode launches write up to ~264; `split_block` takes them all in
    one step there). A step issues all its loads before its first reduction, so they share one memory
    round trip: each reduction ends in a barrier that a later load would wait behind."""
    offs_j = tl.arange(0, HC_PAD)
    j_ok = offs_j < HC
    jk = 2 * HC + offs_j[:, None] * HC + offs_j[None, :]
    jk_ok = j_ok[:, None] & j_ok[None, :]
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    pre_mix = tl.zeros((BLOCK_T, HC_PAD), dtype=tl.float32)
    post_mix = tl.zeros((BLOCK_T, HC_PAD), dtype=tl.float32)
    comb_mix = tl.zeros((BLOCK_T, HC_PAD, HC_PAD), dtype=tl.float32)
    for s0 in range(0, splits, SPLIT_BLOCK):
        offs_s = s0 + tl.arange(0, SPLIT_BLOCK)
        rows = offs_s[:, None] * n_tok + offs_t[None, :]  # [SB, BT]
        st_mask = (offs_s < splits)[:, None] & t_mask[None, :]
        part = rows * MIX_PAD
        stj_mask = st_mask[:, :, None] & j_ok[None, None, :]
        sq_p = tl.load(sqpart_ptr + rows, mask=st_mask, other=0.0)
        if PRE:
            pre_p = tl.load(dpart_ptr + part[:, :, None] + offs_j[None, None, :], mask=stj_mask, other=0.0)
        if MIXES:
            post_p = tl.load(dpart_ptr + part[:, :, None] + HC + offs_j[None, None, :], mask=stj_mask, other=0.0)
            comb_p = tl.load(dpart_ptr + part[:, :, None, None] + jk[None, None, :, :],
                             mask=st_mask[:, :, None, None] & jk_ok[None, None, :, :], other=0.0)
        sq += tl.sum(sq_p, axis=0)
        if PRE:
            pre_mix += tl.sum(pre_p, axis=0)
        if MIXES:
            post_mix += tl.sum(post_p, axis=0)
            comb_mix += tl.sum(comb_p, axis=0)
    return sq, pre_mix, post_mix, comb_mix


@_jit
def _rho(sq, dim, rms_eps, HC: tl.constexpr):
    """ρ = rsqrt(Σx̂²/(H·D) + rms_eps) [BT] from the summed sq [BT]."""
    return tl.rsqrt(sq / (HC * dim) + rms_eps)


@_jit
def _pre_of(pre_mix, rho, s_pre, b_pre, hc_eps, HC: tl.constexpr, HC_PAD: tl.constexpr):
    """pre [BT, HC_PAD] = σ(μ_pre·ρ·scale + base) + hc_eps, 0 on padded streams (spec §6.2 step 5)."""
    pre = tl.sigmoid(pre_mix * rho[:, None] * s_pre + b_pre[None, :]) + hc_eps
    return tl.where((tl.arange(0, HC_PAD) < HC)[None, :], pre, 0.0)


@_jit
def _post_comb_of(post_mix, comb_mix, rho, s_post, s_comb, b_post, b_comb, t_mask, hc_eps, sinkhorn_iters,
                  HC: tl.constexpr, HC_PAD: tl.constexpr):
    """post [BT, HC_PAD] and comb [BT, HC_PAD, HC_PAD] (spec §6.2 steps 6-8)."""
    j_ok = tl.arange(0, HC_PAD) < HC
    post = 2.0 * tl.sigmoid(post_mix * rho[:, None] * s_post + b_post[None, :])
    comb = _sinkhorn(comb_mix * rho[:, None, None] * s_comb + b_comb[None, :, :],
                     t_mask[:, None, None] & (j_ok[:, None] & j_ok[None, :])[None, :, :], hc_eps, sinkhorn_iters)
    return post, comb


@_jit
def _store_mixes(post_ptr, comb_ptr, post, comb, offs_t, t_mask, HC: tl.constexpr, HC_PAD: tl.constexpr):
    """Store post [BT, HC_PAD] and comb [BT, HC_PAD, HC_PAD] of tokens `offs_t` (padding dropped)."""
    offs_j = tl.arange(0, HC_PAD)
    j_ok = offs_j < HC
    tl.store(post_ptr + offs_t[:, None] * HC + offs_j[None, :], post, mask=t_mask[:, None] & j_ok[None, :])
    tl.store(comb_ptr + offs_t[:, None, None] * (HC * HC) + offs_j[None, :, None] * HC + offs_j[None, None, :],
             comb, mask=t_mask[:, None, None] & (j_ok[:, None] & j_ok[None, :])[None, :, :])


@_jit
def _block_mixes(dpart_ptr, sqpart_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, n_tok, dim, splits, rms_eps, hc_eps,
                 sinkhorn_iters, store, HC: tl.constexpr, HC_PAD: tl.constexpr, MIX_PAD: tl.constexpr,
                 BLOCK_T: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """An epilogue program's token block (program_id(0)): (offs_t [BT], t_mask [BT], tj_mask [BT, HC_PAD],
    pre [BT, HC_PAD] (0 on padded streams)) from the statistics partials, in the order of spec §6.2; post
    [BT, HC_PAD] and comb [BT, HC_PAD, HC_PAD] (fp32) are stored where `store`."""
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = offs_t < n_tok
    tj_mask = t_mask[:, None] & (tl.arange(0, HC_PAD) < HC)[None, :]
    s_pre, s_post, s_comb, b_pre, b_post, b_comb = _site_params(base_ptr, scale_ptr, HC, HC_PAD)
    sq, pre_mix, post_mix, comb_mix = _partial_sums(dpart_ptr, sqpart_ptr, offs_t, t_mask, n_tok, splits, HC,
                                                    HC_PAD, MIX_PAD, BLOCK_T, SPLIT_BLOCK, True, True)
    rho = _rho(sq, dim, rms_eps, HC)
    post, comb = _post_comb_of(post_mix, comb_mix, rho, s_post, s_comb, b_post, b_comb, t_mask, hc_eps,
                               sinkhorn_iters, HC, HC_PAD)
    pre = _pre_of(pre_mix, rho, s_pre, b_pre, hc_eps, HC, HC_PAD)
    if store:
        _store_mixes(post_ptr, comb_ptr, post, comb, offs_t, t_mask, HC, HC_PAD)
    return offs_t, t_mask, tj_mask, pre


@_jit
def _mhc_epilogue_kernel(
    x_ptr, dpart_ptr, sqpart_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, u_ptr,
    n_tok, dim, splits, rms_eps, hc_eps, sinkhorn_iters,
    HC: tl.constexpr, HC_PAD: tl.constexpr, MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_BLOCK: tl.constexpr, ROLE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (t-block, d-block): reduce the partials -> pre (every D-block: H values per token,
    cheaper than another launch) and store its slice of u; D-block 0 then runs the Sinkhorn and
    stores post and comb (the collapse needs only pre). The x tile, base and scale are loaded before
    the partials' reductions, so one memory round trip precedes the arithmetic.
    ROLE 1: the collapse alone (every D-block; no post / comb partials loaded); ROLE 2 (grid
    [t-blocks, 1]): the mixes alone (no x tile, no u): two launches that may run on two streams, so
    that the Sinkhorn leaves the launch the sublayer waits for (`_launch_epilogue`); ROLE 0 both."""
    pdl_prologue(PDL)
    pid_d = tl.program_id(1)
    offs_j = tl.arange(0, HC_PAD)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < dim
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = offs_t < n_tok
    tj_mask = t_mask[:, None] & (offs_j < HC)[None, :]
    if ROLE != 2:
        x3 = tl.load(x_ptr + offs_t[:, None, None] * (HC * dim) + offs_j[None, :, None] * dim
                     + offs_d[None, None, :], mask=tj_mask[:, :, None] & d_mask[None, None, :],
                     other=0.0).to(tl.float32)
    s_pre, s_post, s_comb, b_pre, b_post, b_comb = _site_params(base_ptr, scale_ptr, HC, HC_PAD)
    sq, pre_mix, post_mix, comb_mix = _partial_sums(dpart_ptr, sqpart_ptr, offs_t, t_mask, n_tok, splits, HC,
                                                    HC_PAD, MIX_PAD, BLOCK_T, SPLIT_BLOCK, ROLE != 2, ROLE != 1)
    rho = _rho(sq, dim, rms_eps, HC)
    if ROLE != 2:
        pre = _pre_of(pre_mix, rho, s_pre, b_pre, hc_eps, HC, HC_PAD)
        u = tl.sum(pre[:, :, None] * x3, axis=1)  # [BT, BD]
        tl.store(u_ptr + offs_t[:, None] * dim + offs_d[None, :], u.to(u_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & d_mask[None, :])
    if ROLE == 0:
        mixes = pid_d == 0  # both parts in one launch: D-block 0 also runs the Sinkhorn
    else:
        mixes = ROLE == 2  # one part per launch: a constant, so the other part is not compiled
    if mixes:
        post, comb = _post_comb_of(post_mix, comb_mix, rho, s_post, s_comb, b_post, b_comb, t_mask, hc_eps,
                                   sinkhorn_iters, HC, HC_PAD)
        _store_mixes(post_ptr, comb_ptr, post, comb, offs_t, t_mask, HC, HC_PAD)


@_jit
def _mhc_post_kernel(
    f_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, n_tok, dim,
    HC: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """X'[t, k, d] for a [BLOCK_T, BLOCK_D] tile, all HC output streams (inputs loaded once)."""
    pdl_prologue(PDL)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_j = tl.arange(0, HC_PAD)
    t_mask = offs_t < n_tok
    d_mask = offs_d < dim
    td_mask = t_mask[:, None] & d_mask[None, :]
    x3 = tl.load(x_ptr + offs_t[:, None, None] * (HC * dim) + offs_j[None, :, None] * dim + offs_d[None, None, :],
                 mask=t_mask[:, None, None] & (offs_j[None, :, None] < HC) & d_mask[None, None, :],
                 other=0.0).to(tl.float32)
    f = tl.load(f_ptr + offs_t[:, None] * dim + offs_d[None, :], mask=td_mask, other=0.0).to(tl.float32)
    for k in tl.static_range(HC):
        xk = _post_stream(x3, f, post_ptr, comb_ptr, offs_t, offs_j, t_mask, k, HC)
        tl.store(out_ptr + offs_t[:, None] * (HC * dim) + k * dim + offs_d[None, :],
                 xk.to(out_ptr.dtype.element_ty), mask=td_mask)


# ------------------------------------------------------------------------------------ launchers


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # Triton interpreter on CPU: few programs keep it fast, yet >1 split is exercised


# Up to this many tokens the statistics pass splits the HC streams over programs too
# (`_mhc_stats_kernel` SPLIT_STREAMS) and the epilogues take one token per program row block. The
# unfolded sites (the model folded the norm only up to 4 tokens then; now `mhc_norm.folds`) at 8 / 16 tokens:
# 11.85 -> 9.39 / 12.08 -> 9.78 µs per site split up to 16 against up to 4 (one H100, D = 2048,
# `bench/mhc_norm_site.py --tokens 8,16 --split-streams 8,16`, mhc-norm-split-h100-s28.json). Up to
# 32 lost: 12.26 -> 12.81 µs at 32 tokens (`bench/gpu_session29.sh b`, mhc-norm-split32-h100-s29.json).
SPLIT_STREAMS_MAX_TOKENS = 16


def _stats_tiles(n_tok: int, fused: bool) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps) of the statistics kernel. tl.dot needs >= 16 token rows; more
    rows per tile re-read fn (0.8 MB at D = 2048, 1.5 MB for Flash) from L2 fewer times."""
    if n_tok <= 8:  # bench/decode_sweep.py on one H200 (decode-sweep-h200.json), CUDA-graph replays at 1-8
        # tokens: the unfused pass 4.8-5.1 µs with 4 warps vs 6.2-6.6 µs with 8. Narrower D blocks were
        # faster still (3.4 µs) but write 4x the partials, and the epilogue that reduces them then cost
        # more than they saved in the whole step (graph-profile-h200-s6*.json).
        # The post_pre site at 4 warps too: 6.96 -> 6.00 µs per folded site at 1 token, 7.14 -> 6.11 at 4,
        # 19.47 -> 16.41 at 8 (one H200, D = 2048, `bench/gpu_session28.sh b`, mhc-norm-warps-h200-s28.json).
        return 16, 64, 4
    # `--mhc-tokens 64,256,320` (mhc-stats-tokens-h200.json; v4-mini and V4-Flash widths): at 64 tokens
    # 16 x 64 tiles at 4 warps (fused 5.6 / 7.5 µs vs 11.9 / 19.6 at 8 warps); from 256 tokens on
    # (verify blocks, many requests, the drafter's γ rows per request) 64-token tiles read fn a quarter
    # as often: fused 62.7 -> 9.3 µs (v4-mini) and 124.6 -> 15.5 µs (Flash) at 256 tokens.
    return (16, 64, 4) if n_tok <= 64 else (64, 32, 4)


def _launch_stats(src: torch.Tensor, fn: torch.Tensor, n_hc: int, dim: int, fused=None, tiles=None):
    """Statistics pass over `src` [N, H, D]; with `fused` = (f, post, comb, x_out) the tiles of
    `src` are not read directly but computed as X' and written to x_out. Returns (dpart, sqpart).
    `tiles` (BLOCK_T, BLOCK_D, num_warps) overrides `_stats_tiles` (bench/decode_sweep.py)."""
    n_tok = src.shape[0]
    n_mix = fn.shape[0]
    block_t, block_d, warps = tiles or _stats_tiles(n_tok, fused is not None)
    if tiles is None and src.dtype == torch.float32:
        # fp32 x takes the 3-pass TF32 dot: at 4 warps the 16 x 64 decode tile spills on sm_90 (255
        # registers + 8 bytes of stack, triton 3.6); at 8 it fits (223). bf16 streams keep the measured 4.
        warps = max(warps, 8)
    n_tblocks = triton.cdiv(n_tok, block_t)
    n_dblocks = triton.cdiv(dim, block_d)
    split_streams = n_tok <= SPLIT_STREAMS_MAX_TOKENS
    per_split = n_hc if split_streams else 1
    # Split K until the grid covers ~2 waves of SMs: a decode step has one t-block only.
    splits = max(1, min(n_dblocks, triton.cdiv(2 * _num_sms(src.device), n_tblocks * per_split)))
    mix_pad = max(16, triton.next_power_of_2(n_mix))  # tl.dot needs N >= 16 on the GPU
    dpart = torch.empty((splits * per_split, n_tok, mix_pad), device=src.device, dtype=torch.float32)
    sqpart = torch.empty((splits * per_split, n_tok), device=src.device, dtype=torch.float32)
    f, post, comb, x_out = fused if fused is not None else (src, src, src, src)  # unused if not fused
    pdl = pdl_launch(src.device, n_tblocks * splits * per_split)
    _mhc_stats_kernel[(n_tblocks, splits * per_split)](
        src, f, post, comb, x_out, fn, dpart, sqpart, n_tok, dim, splits, triton.cdiv(n_dblocks, splits),
        HC=n_hc, HC_PAD=triton.next_power_of_2(n_hc), MIX=n_mix, MIX_PAD=mix_pad,
        BLOCK_T=block_t, BLOCK_D=block_d, FUSE_POST=fused is not None, X_IS_TF32=src.dtype != torch.float32,
        SPLIT_STREAMS=split_streams, PREFETCH=prefetch_launch(pdl, fn), PDL=pdl, launch_pdl=pdl, num_warps=warps,
    )
    return dpart, sqpart


def split_block(n_partials: int, block_t: int) -> int:
    """Partials an epilogue reduces per step (`_partial_sums`' SPLIT_BLOCK): all of them in one load
    round for one-token tiles (up to 256: at most a few thousand fp32 values per program), 8 per
    step for the 4-token tiles, whose [8, 4, 4, 4] comb loads already fill their registers."""
    return min(256, triton.next_power_of_2(n_partials)) if block_t == 1 else 8


def launch_epilogue_parts(mixes_on, whole, mixes, rest, *partials: torch.Tensor) -> None:
    """A site epilogue's launches (`mhc`'s, `mhc_norm`'s and `mhc_v41`'s): `whole()`, one launch, where
    `mixes_on` is None; else `mixes()` (post and comb) under `mixes_on()` (a side stream's fork), then
    `rest()` on the caller's stream. The statistics `partials` the mixes read were made on the
    caller's stream, which drops them on return: marking them in use by the mixes' stream keeps the
    allocator from handing their memory out again before that stream has read them."""
    if mixes_on is None:
        whole()
        return
    with mixes_on():
        mixes()  # first: it waits on the statistics only
        for t in partials:
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))
    rest()


def _launch_epilogue(x: torch.Tensor, dpart, sqpart, base, scale, rms_eps, hc_eps, sinkhorn_iters, mixes_on=None):
    """post [N, H] fp32, comb [N, H, H] fp32, u [N, D] x.dtype from the statistics partials.
    `mixes_on` (a context-manager factory, e.g. a side stream's fork): the mixes (post, comb) are a
    launch of their own under `mixes_on()` and u one on the current stream, the same bits; the
    caller joins that stream before it reads post or comb."""
    n_tok, n_hc, dim = x.shape
    post = torch.empty((n_tok, n_hc), device=x.device, dtype=torch.float32)
    comb = torch.empty((n_tok, n_hc, n_hc), device=x.device, dtype=torch.float32)
    u = torch.empty((n_tok, dim), device=x.device, dtype=x.dtype)
    # one token per program row block where the statistics split the streams (few tokens, many partials)
    block_t, block_d = (1 if n_tok <= SPLIT_STREAMS_MAX_TOKENS else 4), min(256, triton.next_power_of_2(dim))
    grid = (triton.cdiv(n_tok, block_t), triton.cdiv(dim, block_d))

    def launch(grid, role: int) -> None:
        pdl = pdl_launch(x.device, math.prod(grid))
        _mhc_epilogue_kernel[grid](
            x, dpart, sqpart, base, scale, post, comb, u, n_tok, dim, dpart.shape[0],
            float(rms_eps), float(hc_eps), int(sinkhorn_iters),
            HC=n_hc, HC_PAD=triton.next_power_of_2(n_hc), MIX_PAD=dpart.shape[2],
            BLOCK_T=block_t, BLOCK_D=block_d, SPLIT_BLOCK=split_block(dpart.shape[0], block_t),
            ROLE=role, PDL=pdl, launch_pdl=pdl,
        )

    launch_epilogue_parts(mixes_on, lambda: launch(grid, 0), lambda: launch((grid[0], 1), 2),
                          lambda: launch(grid, 1), dpart, sqpart)
    return post, comb, u


def mhc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
            rms_eps: float, hc_eps: float, sinkhorn_iters: int, mixes_on=None):
    """Fused `mhc_pre_ref` (same signature, shapes and dtypes): statistics pass + epilogue (`mixes_on`:
    its post and comb launched under it, `_launch_epilogue`)."""
    require_triton()
    _, n_hc, dim = _check_pre_args(x, fn, base, scale, sinkhorn_iters)
    x = x.contiguous()
    dpart, sqpart = _launch_stats(x, fn.contiguous(), n_hc, dim)
    return _launch_epilogue(x, dpart, sqpart, base.contiguous(), scale.contiguous(),
                            rms_eps, hc_eps, sinkhorn_iters, mixes_on=mixes_on)


def mhc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Fused `mhc_post_ref` (same signature): one pass, X' [N, H, D] in x.dtype."""
    require_triton()
    _check_post_args(f, x, post, comb)
    n_tok, n_hc, dim = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    block_t, block_d = 4, min(256, triton.next_power_of_2(dim))
    grid = (triton.cdiv(n_tok, block_t), triton.cdiv(dim, block_d))
    pdl = pdl_launch(x.device, math.prod(grid))
    _mhc_post_kernel[grid](
        f.contiguous(), x.contiguous(), post.float().contiguous(), comb.float().contiguous(), out,
        n_tok, dim, HC=n_hc, HC_PAD=triton.next_power_of_2(n_hc), BLOCK_T=block_t, BLOCK_D=block_d,
        PDL=pdl, launch_pdl=pdl,
    )
    return out


def mhc_post_pre(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                 rms_eps: float, hc_eps: float, sinkhorn_iters: int, mixes_on=None):
    """Fused `mhc_post_pre_ref`: X' written and the next site's statistics accumulated in one pass
    (`mixes_on` as `mhc_pre`'s)."""
    require_triton()
    _check_post_args(f, x, post, comb)
    _, n_hc, dim = _check_pre_args(x, fn, base, scale, sinkhorn_iters)
    x = x.contiguous()
    x_new = torch.empty_like(x)
    fused = (f.contiguous(), post.float().contiguous(), comb.float().contiguous(), x_new)
    dpart, sqpart = _launch_stats(x, fn.contiguous(), n_hc, dim, fused=fused)
    post2, comb2, u2 = _launch_epilogue(x_new, dpart, sqpart, base.contiguous(), scale.contiguous(),
                                        rms_eps, hc_eps, sinkhorn_iters, mixes_on=mixes_on)
    return x_new, post2, comb2, u2
