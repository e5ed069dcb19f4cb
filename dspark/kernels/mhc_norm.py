"""V4 mHC pre sites with the sublayer's RMSNorm folded in (deepseek_v4 spec §6.2 then §5).

Ops (each `<op>` is Triton, `<op>_ref` is torch, same signature):

* ``mhc_pre_norm(x, fn, base, scale, norm_weight, *, rms_eps, hc_eps, sinkhorn_iters, norm_eps)
  -> (post, comb, h)``: `mhc_pre` of one site, then h = RMSNorm(u) with the sublayer's norm weight
  (attn_norm / ffn_norm): the sublayer input, normalised;
* ``mhc_post_pre_norm(f, x, post, comb, fn, base, scale, norm_weight, *, ..., norm_eps)
  -> (x_new, post2, comb2, h2)``: `mhc_post_pre`, then the same norm of its u2.

Shape symbols: N tokens, H = n_hc streams, D hidden size, M = (2+H)·H mixes (24 for H = 4).

Every V4 pre site is followed by its sublayer's RMSNorm, which at one decode token is a launch of
its own (2 per layer: 24 of a v4-mini step). Here the statistics pass is `mhc.py`'s unchanged and
the norm moves into the epilogue, so a site is two launches, as `mhc_pre` alone.

The norm needs Σu² over the whole row, and u = Σ_k pre_k x_k needs the site's `pre`, known only
after the statistics' split-K reduction (unlike V4.1, whose collapse weights are carried in: there
the statistics pass takes Σu², `mhc_v41.py`). So each epilogue program, after reducing the mixes,
walks the full row of its tokens once for Σu² (re-collapsing x: 4·D values per token, L2-resident
right after the statistics pass read it), then collapses and normalises its own D-blocks. At decode
sizes the D-blocks spread over programs (the walk is repeated by each, in parallel: a few µs of L2
reads in total); at prefill sizes one program per token block walks the row twice and x is read
twice instead of writing and re-reading u (18·D instead of 14·D bytes per token in bf16).

Rounding: u is rounded to x.dtype before its square is summed and before it is normalised (what the
unfused path stores and RMSNorm reads); then r = rsqrt(Σu²/D + norm_eps) and h = w ⊙ (u · r), in
`rms_norm.py`'s order. post, comb and u come from `mhc_pre`'s statistics kernel and its epilogue's
code (`mhc._block_mixes`, the same collapse); the epilogue's tiles differ at decode sizes, so sums of
4 streams or of the split partials may associate differently (an fp32 ulp). h differs from
`rms_norm(u)` where Σu² is reduced in another order: ~1 fp32 ulp of r, at most 1 ulp of x.dtype per
element (rms_norm's own tolerance).

No host sync, buffers sized from shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import math

import torch

from dspark.kernels.mhc import (
    _check_post_args, _check_pre_args, _launch_stats, _num_sms, _partial_sums, _post_comb_of, _pre_of,
    _rho, _site_params, _store_mixes, launch_epilogue_parts, mhc_post_pre, mhc_post_pre_ref, mhc_pre, mhc_pre_ref,
    split_block,
)
from dspark.kernels.registry import require_triton
from dspark.kernels.rms_norm import rms_norm
from dspark.kernels.rms_norm_ref import rms_norm_ref

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue


def _check_norm_weight(x: torch.Tensor, norm_weight: torch.Tensor) -> None:
    if tuple(norm_weight.shape) != (x.shape[-1],) or not norm_weight.is_floating_point():
        raise ValueError(f"norm_weight must be a float [D] = [{x.shape[-1]}] tensor, "
                         f"got {tuple(norm_weight.shape)} {norm_weight.dtype}")


# ----------------------------------------------------------------------------------- references


def mhc_pre_norm_ref(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     norm_weight: torch.Tensor, *, rms_eps: float, hc_eps: float, sinkhorn_iters: int,
                     norm_eps: float, mixes_on=None):
    """mHC pre of one site (spec §6.2), then the sublayer's RMSNorm of its collapse (spec §5).

    The V4 block's former torch order, op for op: `mhc_pre_ref`, then `rms_norm_ref` (the RMSNorm
    module's reference) on u in x.dtype.

    Parameters
    ----------
    x : [N, H, D] bf16 or fp32 -- the streams at the site.
    fn : [(2+H)·H, H·D] fp32; base : [(2+H)·H] fp32; scale : [3] fp32 -- the site's parameters.
    norm_weight : [D] fp32 -- the sublayer's RMSNorm weight (attn_norm / ffn_norm).
    rms_eps, hc_eps, sinkhorn_iters : as `mhc_pre_ref`; norm_eps : eps of the sublayer RMSNorm.
    mixes_on : where the fused op launches the mixes (`_launch_norm_epilogue`); the reference runs
    in order and takes it only for the same signature.

    Returns
    -------
    post : [N, H] fp32; comb : [N, H, H] fp32; h : [N, D] x.dtype = RMSNorm(Σ_k pre_k · x[:, k]).
    """
    _check_norm_weight(x, norm_weight)
    post, comb, u = mhc_pre_ref(x, fn, base, scale, rms_eps=rms_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
    return post, comb, rms_norm_ref(u, norm_weight, eps=norm_eps, out_dtype=u.dtype)


def mhc_post_pre_norm_ref(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                          fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, *,
                          rms_eps: float, hc_eps: float, sinkhorn_iters: int, norm_eps: float, mixes_on=None):
    """`mhc_post_pre_ref`, then the next sublayer's RMSNorm of its u2 (`rms_norm_ref`).

    Shape: f [N, D], x [N, H, D], post [N, H], comb [N, H, H] (previous site); fn, base, scale,
    norm_weight [D] of the next site. Returns (x_new [N, H, D] x.dtype, post2 [N, H], comb2 [N, H, H],
    h2 [N, D] x.dtype).
    """
    _check_norm_weight(x, norm_weight)
    x_new, post2, comb2, u2 = mhc_post_pre_ref(f, x, post, comb, fn, base, scale, rms_eps=rms_eps, hc_eps=hc_eps,
                                               sinkhorn_iters=sinkhorn_iters)
    return x_new, post2, comb2, rms_norm_ref(u2, norm_weight, eps=norm_eps, out_dtype=u2.dtype)


# --------------------------------------------------------------------------------- Triton kernel


@_jit
def _collapse_tile(x_ptr, pre, offs_t, tj_mask, offs_j, offs_d, d_mask, dim, out_ty,
                   HC: tl.constexpr):
    """u = Σ_k pre_k · x_k for a [BLOCK_T, BLOCK_D] tile, rounded to `out_ty` (as `mhc_pre` stores
    it), returned in fp32. pre [BT, HC_PAD] (0 on padded streams)."""
    x3 = tl.load(x_ptr + offs_t[:, None, None] * (HC * dim) + offs_j[None, :, None] * dim + offs_d[None, None, :],
                 mask=tj_mask[:, :, None] & d_mask[None, None, :], other=0.0).to(tl.float32)
    return tl.sum(pre[:, :, None] * x3, axis=1).to(out_ty).to(tl.float32)


@_jit
def _store_normed_collapse(x_ptr, w_ptr, h_ptr, pre, offs_t, t_mask, tj_mask, dim, n_dblocks, iters, norm_eps,
                           pid_p, n_prog, HC: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """h = w ⊙ u · rsqrt(Σu²/D + norm_eps) with u = Σ_k pre_k x_k for tokens `offs_t` [BT] (t_mask
    [BT]; pre and tj_mask [BT, HC_PAD]): Σu² over the whole row, then program p of P = n_prog stores
    the D-blocks p, p + P, ... (`iters` of them). Shared by every folded epilogue (`hc_head_norm.py` too)."""
    offs_j = tl.arange(0, HC_PAD)
    out_ty = h_ptr.dtype.element_ty
    squares = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for b in range(0, n_dblocks):  # the whole row: every program needs the full Σu²
        offs_d = b * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < dim
        u = _collapse_tile(x_ptr, pre, offs_t, tj_mask, offs_j, offs_d, d_mask, dim, out_ty, HC)
        squares += tl.sum(u * u, axis=1)
    r = tl.rsqrt(squares / dim + norm_eps)  # [BT]
    for it in range(0, iters):  # fixed trip count (see mhc._mhc_stats_kernel); blocks past the end are masked
        offs_d = (pid_p + it * n_prog) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < dim
        u = _collapse_tile(x_ptr, pre, offs_t, tj_mask, offs_j, offs_d, d_mask, dim, out_ty, HC)
        w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        h = w[None, :] * (u * r[:, None])  # rms_norm's order: u · r first, then the weight
        tl.store(h_ptr + offs_t[:, None] * dim + offs_d[None, :], h.to(out_ty), mask=t_mask[:, None] & d_mask[None, :])


@_jit
def _load_row(x_ptr, w_ptr, t, dim, HC: tl.constexpr, HC_PAD: tl.constexpr, ROW: tl.constexpr):
    """Token t's streams [HC_PAD, ROW] in x.dtype and the norm weight [ROW] fp32 (0 past D and on
    padded streams): the whole row in registers, loaded before anything waits on a reduction."""
    offs_j = tl.arange(0, HC_PAD)
    offs_d = tl.arange(0, ROW)
    d_mask = offs_d < dim
    x2 = tl.load(x_ptr + t * (HC * dim) + offs_j[:, None] * dim + offs_d[None, :],
                 mask=(offs_j < HC)[:, None] & d_mask[None, :], other=0.0)
    return x2, tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)


@_jit
def _store_normed_row(h_ptr, x2, w, pre, t, dim, norm_eps, ROW: tl.constexpr):
    """h = w ⊙ u · rsqrt(Σu²/D + norm_eps) of token t from its row in registers: x2 [HC_PAD, ROW],
    w [ROW], pre [HC_PAD]; u = Σ_k pre_k x_k rounded to h's dtype first, as `_collapse_tile`."""
    out_ty = h_ptr.dtype.element_ty
    u = tl.sum(pre[:, None] * x2.to(tl.float32), axis=0).to(out_ty).to(tl.float32)  # [ROW]
    r = tl.rsqrt(tl.sum(u * u, axis=0) / dim + norm_eps)
    offs_d = tl.arange(0, ROW)
    tl.store(h_ptr + t * dim + offs_d, (w * (u * r)).to(out_ty), mask=offs_d < dim)  # rms_norm's order


@_jit
def _row_collapse(x_ptr, w_ptr, h_ptr, dpart_ptr, sqpart_ptr, base_ptr, scale_ptr, t, offs_t, t_mask, n_tok, dim,
                  splits, rms_eps, hc_eps, norm_eps, HC: tl.constexpr, HC_PAD: tl.constexpr, MIX_PAD: tl.constexpr,
                  SPLIT_BLOCK: tl.constexpr, ROW: tl.constexpr):
    """Token t's h from its whole row in registers: the pre partials -> pre -> u -> Σu² -> h."""
    x2, w = _load_row(x_ptr, w_ptr, t, dim, HC, HC_PAD, ROW)
    s_pre, s_post, s_comb, b_pre, b_post, b_comb = _site_params(base_ptr, scale_ptr, HC, HC_PAD)
    sq, pre_mix, post_mix, comb_mix = _partial_sums(dpart_ptr, sqpart_ptr, offs_t, t_mask, n_tok, splits, HC,
                                                    HC_PAD, MIX_PAD, 1, SPLIT_BLOCK, True, False)
    pre = _pre_of(pre_mix, _rho(sq, dim, rms_eps, HC), s_pre, b_pre, hc_eps, HC, HC_PAD)
    _store_normed_row(h_ptr, x2, w, tl.reshape(pre, (HC_PAD,)), t, dim, norm_eps, ROW)


@_jit
def _row_mixes(dpart_ptr, sqpart_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, offs_t, t_mask, n_tok, dim, splits,
               rms_eps, hc_eps, sinkhorn_iters, HC: tl.constexpr, HC_PAD: tl.constexpr, MIX_PAD: tl.constexpr,
               SPLIT_BLOCK: tl.constexpr):
    """Token `offs_t`'s post and comb: the post/comb partials, sigmoids, Sinkhorn, stored."""
    s_pre, s_post, s_comb, b_pre, b_post, b_comb = _site_params(base_ptr, scale_ptr, HC, HC_PAD)
    sq, pre_mix, post_mix, comb_mix = _partial_sums(dpart_ptr, sqpart_ptr, offs_t, t_mask, n_tok, splits, HC,
                                                    HC_PAD, MIX_PAD, 1, SPLIT_BLOCK, False, True)
    post, comb = _post_comb_of(post_mix, comb_mix, _rho(sq, dim, rms_eps, HC), s_post, s_comb, b_post,
                               b_comb, t_mask, hc_eps, sinkhorn_iters, HC, HC_PAD)
    _store_mixes(post_ptr, comb_ptr, post, comb, offs_t, t_mask, HC, HC_PAD)


@_jit
def _mhc_norm_epilogue_kernel(
    x_ptr, dpart_ptr, sqpart_ptr, base_ptr, scale_ptr, w_ptr, post_ptr, comb_ptr, h_ptr,
    n_tok, dim, splits, n_dblocks, iters, rms_eps, hc_eps, norm_eps, sinkhorn_iters,
    HC: tl.constexpr, HC_PAD: tl.constexpr, MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_BLOCK: tl.constexpr, ROW: tl.constexpr,
    ROLE: tl.constexpr, PDL: tl.constexpr,
):
    """ROW > 0 (one token per program row, grid [N, 2]): program (t, 0) loads token t's whole row
    (ROW >= D wide) and the pre partials, then pre -> u -> Σu² -> h in registers, one walk over x;
    program (t, 1) reduces the post/comb partials, runs the Sinkhorn and stores post and comb. The
    collapse needs only pre, so the Sinkhorn runs beside it on another SM instead of before it.
    ROLE 1 / 2 (grid [N, 1]): the collapse / the mixes alone, two launches that may run on two
    streams, so that the Sinkhorn leaves the launch the sublayer waits for (`_launch_norm_epilogue`).

    ROW = 0 (token blocks of BLOCK_T, grid [t-blocks, P]): program p reduces the partials -> pre,
    walks the whole row for Σu², then stores h on the D-blocks p, p + P, ... (`iters` of them);
    p = 0 then runs the Sinkhorn and stores post and comb."""
    pdl_prologue(PDL)
    pid_p = tl.program_id(1)
    if ROW > 0:
        t = tl.program_id(0).to(tl.int64)
        offs_t = t + tl.arange(0, 1)
        t_mask = offs_t < n_tok
        if ROLE == 0:
            role = pid_p  # both parts in one launch: program (t, 0) collapses, (t, 1) mixes
        else:
            role = ROLE - 1  # one part per launch: a constant, so the other part is not compiled
        if role == 0:
            _row_collapse(x_ptr, w_ptr, h_ptr, dpart_ptr, sqpart_ptr, base_ptr, scale_ptr, t, offs_t, t_mask, n_tok,
                          dim, splits, rms_eps, hc_eps, norm_eps, HC, HC_PAD, MIX_PAD, SPLIT_BLOCK, ROW)
        else:
            _row_mixes(dpart_ptr, sqpart_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, offs_t, t_mask, n_tok, dim,
                       splits, rms_eps, hc_eps, sinkhorn_iters, HC, HC_PAD, MIX_PAD, SPLIT_BLOCK)
    else:
        offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_mask = offs_t < n_tok
        tj_mask = t_mask[:, None] & (tl.arange(0, HC_PAD) < HC)[None, :]
        s_pre, s_post, s_comb, b_pre, b_post, b_comb = _site_params(base_ptr, scale_ptr, HC, HC_PAD)
        sq, pre_mix, post_mix, comb_mix = _partial_sums(dpart_ptr, sqpart_ptr, offs_t, t_mask, n_tok, splits, HC,
                                                        HC_PAD, MIX_PAD, BLOCK_T, SPLIT_BLOCK, True, True)
        rho = _rho(sq, dim, rms_eps, HC)
        _store_normed_collapse(x_ptr, w_ptr, h_ptr, _pre_of(pre_mix, rho, s_pre, b_pre, hc_eps, HC, HC_PAD), offs_t,
                               t_mask, tj_mask, dim, n_dblocks, iters, norm_eps, pid_p, tl.num_programs(1), HC, HC_PAD,
                               BLOCK_T, BLOCK_D)
        if pid_p == 0:
            post, comb = _post_comb_of(post_mix, comb_mix, rho, s_post, s_comb, b_post, b_comb, t_mask, hc_eps,
                                       sinkhorn_iters, HC, HC_PAD)
            _store_mixes(post_ptr, comb_ptr, post, comb, offs_t, t_mask, HC, HC_PAD)


# ------------------------------------------------------------------------------------ launchers


def _norm_tiles(n_tok: int, dim: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D) of the epilogue. Up to 4 tokens (one decode step of a few requests) one
    token per program row block, so no lane idles on a masked token and the Σu² walk takes few
    wide steps (2 at D = 2048); above, `mhc._launch_epilogue`'s 4 × 256 tiles. Both hold a
    [BT, 4, BD] fp32 tile of 4096 values (32 per thread at 4 warps)."""
    if n_tok <= 4:
        return 1, min(1024, triton.next_power_of_2(dim))
    return 4, min(256, triton.next_power_of_2(dim))


def norm_epilogue_grid(n_tok: int, dim: int, device: torch.device, tiles=None):
    """(BLOCK_T, BLOCK_D, D-blocks, grid) of a folded epilogue (`_store_normed_collapse`): D-blocks
    spread over programs until the grid covers ~2 waves of SMs (decode); one program per token block
    once the token blocks alone do (prefill: each walk of the row is then x's only re-read).
    `tiles` (BLOCK_T, BLOCK_D) overrides `_norm_tiles`."""
    block_t, block_d = tiles or _norm_tiles(n_tok, dim)
    n_tblocks, n_dblocks = triton.cdiv(n_tok, block_t), triton.cdiv(dim, block_d)
    programs = max(1, min(n_dblocks, triton.cdiv(2 * _num_sms(device), n_tblocks)))
    return block_t, block_d, n_dblocks, (n_tblocks, programs)


# The widest token row the decode epilogue holds in registers (`_mhc_norm_epilogue_kernel` ROW):
# V4-Flash's D = 4096 (4 streams: 16384 values, 128 per thread at 4 warps). V4-Pro's 7168 pads to
# 8192, which spilled registers on sm_90 at 16 warps (24 bytes, triton 3.6): it takes the walks.
ROW_MAX = 4096
# The most tokens the row epilogue takes (one token per program row); above, the 4 × 256 token blocks
# walk the row. The ops fold the norm wherever it applies (`folds`). Raised from 4 on one H100 (v4-mini
# graph step, 4K context, `bash bench/gpu_session31.sh b`, v4-fold16-ab-h100-s31.json, two alternating
# rounds): 8 requests 2.485 -> 2.429 ms, 16 requests 3.217 -> 3.132 ms, 4 requests x 4-token verify
# blocks 3.222 -> 3.131 ms (1.02-1.03x), where these sites ran the unfused Triton pair.
ROW_MAX_TOKENS = 16


def row_tiles(n_tok: int, dim: int) -> tuple[int, int] | None:
    """(ROW, num_warps) of the one-walk decode epilogue, or None where it does not apply (more than
    ROW_MAX_TOKENS tokens; rows wider than ROW_MAX). 4 warps at every width:
    on the H200 (`bench/mhc_epilogue.py`, `bench/results/mhc-epilogue-h200.json`, 1 and 4 tokens) D = 2048
    took 4.1-4.2 µs at 4 warps, 6.8-6.9 at 8; D = 4096 4.5 µs at 4 warps (128 values of x per thread,
    no spill on sm_90), 6.0 at 8, 10.1 at 16."""
    row = triton.next_power_of_2(dim)
    if n_tok > ROW_MAX_TOKENS or row > ROW_MAX:
        return None
    return row, 4


def _launch_norm_epilogue(x: torch.Tensor, dpart, sqpart, base, scale, norm_weight, eps: dict, tiles=None,
                          variant: str = "row", mixes_on=None):
    """post [N, H] fp32, comb [N, H, H] fp32, h [N, D] x.dtype from the statistics partials over x.

    `variant`: "row" (the shipped choice: `row_tiles` where they apply, else the walk) or "walk" (token
    blocks that walk the row, Sinkhorn once per block, at every size: the benches' comparison).
    `tiles` (BLOCK_T, BLOCK_D) overrides `_norm_tiles` of the walks, or (ROW, num_warps) the row
    tiles of "row" (benches). `mixes_on` (a context-manager factory, e.g. a side stream's fork): on
    the row tiles, the mixes (post, comb) are a launch of their own under `mixes_on()` and h one on
    the current stream, the same bits; the caller joins that stream before it reads post or comb.
    The walks run everything in one launch."""
    if variant not in ("row", "walk"):
        raise ValueError(f"variant must be 'row' or 'walk', got {variant!r}")
    n_tok, n_hc, dim = x.shape
    post = torch.empty((n_tok, n_hc), device=x.device, dtype=torch.float32)
    comb = torch.empty((n_tok, n_hc, n_hc), device=x.device, dtype=torch.float32)
    h = torch.empty((n_tok, dim), device=x.device, dtype=x.dtype)
    row = (tiles or row_tiles(n_tok, dim)) if variant == "row" else None
    if row is not None:
        (row_width, warps), grid = row, (n_tok, 2)
        block_t, block_d, n_dblocks = 1, row_width, 1
        if row_width < dim:
            raise ValueError(f"row tiles ({row_width}) narrower than D = {dim}")
    else:
        row_width, warps = 0, 4
        block_t, block_d, n_dblocks, grid = norm_epilogue_grid(n_tok, dim, x.device, tiles)

    def launch(grid, role: int) -> None:
        pdl = pdl_launch(x.device, math.prod(grid))
        _mhc_norm_epilogue_kernel[grid](
            x, dpart, sqpart, base, scale, norm_weight, post, comb, h, n_tok, dim, dpart.shape[0], n_dblocks,
            triton.cdiv(n_dblocks, grid[1]), float(eps["rms_eps"]), float(eps["hc_eps"]), float(eps["norm_eps"]),
            int(eps["sinkhorn_iters"]), HC=n_hc, HC_PAD=triton.next_power_of_2(n_hc), MIX_PAD=dpart.shape[2],
            BLOCK_T=block_t, BLOCK_D=block_d, SPLIT_BLOCK=split_block(dpart.shape[0], block_t), PDL=pdl,
            ROW=row_width, ROLE=role, launch_pdl=pdl, num_warps=warps,
        )

    launch_epilogue_parts(None if row is None else mixes_on, lambda: launch(grid, 0), lambda: launch((n_tok, 1), 2),
                          lambda: launch((n_tok, 1), 1), dpart, sqpart)
    return post, comb, h


# Where the row epilogue does not apply (rows wider than ROW_MAX: V4-Pro), the ops fold the norm up
# to this many tokens, and above it run the unfused Triton pair (`mhc_pre` / `mhc_post_pre`, then
# `rms_norm`), which they match within rms_norm's tolerance. On one H200 (v4-mini graph step, 4K,
# `bench/gpu_session9.sh d`) the fold took 1.869 -> 1.828 ms at one request but 2.993 -> 3.113 ms at 8,
# where the epilogue's 4 x 256 tiles walk each token's whole row in every program.
FOLD_MAX_TOKENS = 4


def folds(n_tok: int, dim: int) -> bool:
    """Whether the ops fold the norm into the site for `n_tok` tokens of width `dim`: the row epilogue
    where it applies (`row_tiles`), else the walking one up to FOLD_MAX_TOKENS tokens."""
    return n_tok <= FOLD_MAX_TOKENS or row_tiles(n_tok, dim) is not None


def _normed(op_out: tuple, norm_weight: torch.Tensor, norm_eps: float) -> tuple:
    """(..., u) of the unfused site op -> (..., rms_norm(u)) by the Triton RMSNorm."""
    *head, u = op_out
    return (*head, rms_norm(u, norm_weight, eps=norm_eps, out_dtype=u.dtype))


def mhc_pre_norm(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                 norm_weight: torch.Tensor, *, rms_eps: float, hc_eps: float, sinkhorn_iters: int,
                 norm_eps: float, mixes_on=None):
    """Fused `mhc_pre_norm_ref` (same signature, shapes and dtypes): `mhc_pre`'s statistics pass +
    the epilogue with the norm folded in (where `folds`; `mixes_on`: its mixes launched under it,
    `_launch_norm_epilogue`, or `mhc._launch_epilogue`'s in the unfused pair)."""
    require_triton()
    _, n_hc, dim = _check_pre_args(x, fn, base, scale, sinkhorn_iters)
    _check_norm_weight(x, norm_weight)
    if not folds(x.shape[0], dim):
        return _normed(mhc_pre(x, fn, base, scale, rms_eps=rms_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters,
                               mixes_on=mixes_on), norm_weight, norm_eps)
    x = x.contiguous()
    dpart, sqpart = _launch_stats(x, fn.contiguous(), n_hc, dim)
    eps = dict(rms_eps=rms_eps, hc_eps=hc_eps, norm_eps=norm_eps, sinkhorn_iters=sinkhorn_iters)
    return _launch_norm_epilogue(x, dpart, sqpart, base.contiguous(), scale.contiguous(),
                                 norm_weight.float().contiguous(), eps, mixes_on=mixes_on)


def mhc_post_pre_norm(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, *,
                      rms_eps: float, hc_eps: float, sinkhorn_iters: int, norm_eps: float, mixes_on=None):
    """Fused `mhc_post_pre_norm_ref`: `mhc_post_pre`'s statistics pass (X' written tile by tile),
    then the epilogue with the norm folded in, over X' (where `folds`; `mixes_on` as
    `mhc_pre_norm`'s)."""
    require_triton()
    _check_post_args(f, x, post, comb)
    _, n_hc, dim = _check_pre_args(x, fn, base, scale, sinkhorn_iters)
    _check_norm_weight(x, norm_weight)
    if not folds(x.shape[0], dim):
        return _normed(mhc_post_pre(f, x, post, comb, fn, base, scale, rms_eps=rms_eps, hc_eps=hc_eps,
                                    sinkhorn_iters=sinkhorn_iters, mixes_on=mixes_on), norm_weight, norm_eps)
    x = x.contiguous()
    x_new = torch.empty_like(x)
    fused = (f.contiguous(), post.float().contiguous(), comb.float().contiguous(), x_new)
    dpart, sqpart = _launch_stats(x, fn.contiguous(), n_hc, dim, fused=fused)
    eps = dict(rms_eps=rms_eps, hc_eps=hc_eps, norm_eps=norm_eps, sinkhorn_iters=sinkhorn_iters)
    return (x_new, *_launch_norm_epilogue(x_new, dpart, sqpart, base.contiguous(), scale.contiguous(),
                                          norm_weight.float().contiguous(), eps, mixes_on=mixes_on))
