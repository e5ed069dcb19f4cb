"""V4's output collapse `hc_head` with the final RMSNorm folded in (deepseek_v4 spec §6.4 then §5).

Op (`hc_head_norm` is Triton, `hc_head_norm_ref` torch, same signature):

* ``hc_head_norm(x, fn, base, scale, norm_weight, *, rms_eps, hc_eps, norm_eps) -> h``:
  pre = σ(RMS(x̂)·(x̂·fnᵀ)·scale + base) + hc_eps, u = Σ_k pre_k x_k (in x.dtype), then
  h = RMSNorm(u) with the model's final `norm` weight: the LM head's input.

Shape symbols: N tokens, H = n_hc streams, D hidden size; the head has M = H mixes (4 for H = 4).

In torch the collapse and the norm are ~16 small launches per decode step (the RMS statistic, the
[N, H·D] × [H·D, H] GEMM, the sigmoid, the collapse, the norm's own ops). Here they are two, as an
mHC site folded with its sublayer norm (`mhc_norm.py`):

1. `mhc.py`'s split-K statistics kernel, unchanged: fn [H, H·D] is a mix matrix of M = H rows
   (padded to MIX_PAD = 16 columns of the partials, the tensor cores' minimum; the padded rows of fn
   load as 0 and are never read back);
2. an epilogue that reduces the H pre partials and Σx̂², pre = σ(d·ρ·scale + base) + hc_eps, then
   `mhc_norm`'s folded tail (`_store_normed_collapse`): every program walks its tokens' whole row for
   Σu², then normalises and stores its own D-blocks (`norm_epilogue_grid`: decode tiles 1 × 1024 up to
   4 tokens, 4 × 256 above). It folds at every N: the alternative here is the torch chain, not a
   Triton pair (`mhc_norm.FOLD_MAX_TOKENS` compares with one).

Rounding: u is rounded to x.dtype before Σu² and the norm (what `hc_head` returns and `RMSNorm`
reads), then r = rsqrt(Σu²/D + norm_eps), h = w ⊙ (u · r) in `rms_norm.py`'s order. The GEMM runs
as two TF32 passes (`mhc._dot_fp32`, ≈ fp32) in split-K order, so pre differs from the reference by
fp32 rounding and h by ≤ 1 ulp of x.dtype where u rounds differently: mHC's tolerances.

Autograd: no backward; while autograd records (`autograd.records_grad`) the op runs its reference.
No host sync, buffers sized from shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import math

import torch

from dspark.kernels.autograd import records_grad
from dspark.kernels.mhc import _launch_stats, split_block
from dspark.kernels.mhc_norm import _check_norm_weight, _store_normed_collapse, norm_epilogue_grid
from dspark.kernels.registry import require_triton
from dspark.kernels.rms_norm_ref import rms_norm_ref
from dspark.models.deepseek_v4.mhc import hc_head

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)
from dspark.kernels.triton_compat import pdl_launch, pdl_prologue


def _check_head_args(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     norm_weight: torch.Tensor) -> tuple[int, int, int]:
    """Validate hc_head_norm shapes and dtypes; return (N, H, D)."""
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a float [N, n_hc, D] tensor, got {x.dtype} of shape {tuple(x.shape)}")
    n_tok, n_hc, dim = x.shape
    if tuple(fn.shape) != (n_hc, n_hc * dim):
        raise ValueError(f"fn must be [n_hc, n_hc*D] = [{n_hc}, {n_hc * dim}], got {tuple(fn.shape)}")
    if tuple(base.shape) != (n_hc,):
        raise ValueError(f"base must be [n_hc] = [{n_hc}], got {tuple(base.shape)}")
    if tuple(scale.shape) != (1,):
        raise ValueError(f"scale must be [1], got {tuple(scale.shape)}")
    for name, t in (("fn", fn), ("base", base), ("scale", scale)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (mHC parameters stay fp32), got {t.dtype}")
    _check_norm_weight(x, norm_weight)
    return n_tok, n_hc, dim


# ----------------------------------------------------------------------------------- reference


def hc_head_norm_ref(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     norm_weight: torch.Tensor, *, rms_eps: float, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """The V4 output collapse (spec §6.4), then the final RMSNorm (spec §5).

    The model's former torch order, op for op: `deepseek_v4.mhc.hc_head`, then `rms_norm_ref` (the
    RMSNorm module's reference) on its output in x.dtype.

    Parameters
    ----------
    x : [N, H, D] bf16 or fp32 -- the final residual streams.
    fn : [H, H·D] fp32; base : [H] fp32; scale : [1] fp32 -- `hc_head_{fn,base,scale}`.
    norm_weight : [D] fp32 -- the final `norm` weight (the model's, or an MTP block's).
    rms_eps : eps of the RMS statistic of the streams (rms_norm_eps); hc_eps : added to pre;
    norm_eps : eps of the final RMSNorm.

    Returns
    -------
    h : [N, D] x.dtype = RMSNorm(Σ_k pre_k · x[:, k]).
    """
    _check_head_args(x, fn, base, scale, norm_weight)
    u = hc_head(x, fn, base, scale, hc_eps, rms_eps)
    return rms_norm_ref(u, norm_weight, eps=norm_eps, out_dtype=u.dtype)


def hc_head_then(norm_op):
    """The unfused pair the op replaces, as `hc_head_norm` is called: torch `hc_head`, then `norm_op`
    (the registry's `rms_norm` as a config picks it, as the RMSNorm module calls it). With the
    reference norm this is `hc_head_norm_ref`."""

    def collapse_then_norm(x, fn, base, scale, norm_weight, *, rms_eps: float, hc_eps: float, norm_eps: float):
        u = hc_head(x, fn, base, scale, hc_eps, rms_eps)
        return norm_op(u, norm_weight, eps=norm_eps, out_dtype=u.dtype)

    return collapse_then_norm


# --------------------------------------------------------------------------------- Triton kernel


@_jit
def _head_pre(dpart_ptr, sqpart_ptr, base_ptr, scale_ptr, offs_t, t_mask, n_tok, dim, splits, rms_eps, hc_eps,
              HC: tl.constexpr, HC_PAD: tl.constexpr, MIX_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
              SPLIT_BLOCK: tl.constexpr = 8):
    """Reduce the statistics partials of tokens `offs_t` [BT] -> pre [BT, HC_PAD] fp32 (0 on padded
    streams): σ(d · ρ · scale + base) + hc_eps, ρ = rsqrt(Σx̂²/(H·D) + rms_eps), as `mhc._block_mixes`."""
    offs_j = tl.arange(0, HC_PAD)
    j_ok = offs_j < HC
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    mix = tl.zeros((BLOCK_T, HC_PAD), dtype=tl.float32)
    for s0 in range(0, splits, SPLIT_BLOCK):  # SPLIT_BLOCK partials per step, as `mhc._block_mixes`
        offs_s = s0 + tl.arange(0, SPLIT_BLOCK)
        rows = offs_s[:, None] * n_tok + offs_t[None, :]  # [SB, BT]
        st_mask = (offs_s < splits)[:, None] & t_mask[None, :]
        sq += tl.sum(tl.load(sqpart_ptr + rows, mask=st_mask, other=0.0), axis=0)
        mix += tl.sum(tl.load(dpart_ptr + rows[:, :, None] * MIX_PAD + offs_j[None, None, :],
                              mask=st_mask[:, :, None] & j_ok[None, None, :], other=0.0), axis=0)
    rho = tl.rsqrt(sq / (HC * dim) + rms_eps)  # [BT]
    b = tl.load(base_ptr + offs_j, mask=j_ok, other=0.0)
    pre = tl.sigmoid(mix * rho[:, None] * tl.load(scale_ptr) + b[None, :]) + hc_eps
    return tl.where(j_ok[None, :], pre, 0.0)


@_jit
def _hc_head_norm_kernel(
    x_ptr, dpart_ptr, sqpart_ptr, base_ptr, scale_ptr, w_ptr, h_ptr,
    n_tok, dim, splits, n_dblocks, iters, rms_eps, hc_eps, norm_eps,
    HC: tl.constexpr, HC_PAD: tl.constexpr, MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Program (t-block, p) of P = grid[1]: reduce the partials -> pre (every program: H values per
    token, cheaper than a launch), Σu² over the whole row, then h on the D-blocks p, p + P, ..."""
    pdl_prologue(PDL)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = offs_t < n_tok
    tj_mask = t_mask[:, None] & (tl.arange(0, HC_PAD) < HC)[None, :]
    pre = _head_pre(dpart_ptr, sqpart_ptr, base_ptr, scale_ptr, offs_t, t_mask, n_tok, dim, splits, rms_eps, hc_eps,
                    HC, HC_PAD, MIX_PAD, BLOCK_T, SPLIT_BLOCK)
    _store_normed_collapse(x_ptr, w_ptr, h_ptr, pre, offs_t, t_mask, tj_mask, dim, n_dblocks, iters, norm_eps,
                           tl.program_id(1), tl.num_programs(1), HC, HC_PAD, BLOCK_T, BLOCK_D)


# ------------------------------------------------------------------------------------ launcher


def _launch_head_epilogue(x: torch.Tensor, dpart, sqpart, base, scale, norm_weight, eps: dict, tiles=None):
    """h [N, D] x.dtype from the statistics partials over x. `tiles` (BLOCK_T, BLOCK_D) overrides
    `mhc_norm._norm_tiles` (tests, benches)."""
    n_tok, n_hc, dim = x.shape
    h = torch.empty((n_tok, dim), device=x.device, dtype=x.dtype)
    block_t, block_d, n_dblocks, grid = norm_epilogue_grid(n_tok, dim, x.device, tiles)
    pdl = pdl_launch(x.device, math.prod(grid))
    _hc_head_norm_kernel[grid](
        x, dpart, sqpart, base, scale, norm_weight, h, n_tok, dim, dpart.shape[0], n_dblocks,
        triton.cdiv(n_dblocks, grid[1]), float(eps["rms_eps"]), float(eps["hc_eps"]), float(eps["norm_eps"]),
        HC=n_hc, HC_PAD=triton.next_power_of_2(n_hc), MIX_PAD=dpart.shape[2],
        BLOCK_T=block_t, BLOCK_D=block_d, SPLIT_BLOCK=split_block(dpart.shape[0], block_t), PDL=pdl, launch_pdl=pdl,
    )
    return h


def hc_head_norm(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                 norm_weight: torch.Tensor, *, rms_eps: float, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Fused `hc_head_norm_ref` (same signature, shape and dtype): `mhc.py`'s statistics pass with
    fn's H mixes, then the epilogue with the collapse and the final norm (the reference under autograd)."""
    if records_grad(x, fn, base, scale, norm_weight):
        return hc_head_norm_ref(x, fn, base, scale, norm_weight, rms_eps=rms_eps, hc_eps=hc_eps, norm_eps=norm_eps)
    require_triton()
    _, n_hc, dim = _check_head_args(x, fn, base, scale, norm_weight)
    x = x.contiguous()
    dpart, sqpart = _launch_stats(x, fn.contiguous(), n_hc, dim)
    eps = dict(rms_eps=rms_eps, hc_eps=hc_eps, norm_eps=norm_eps)
    return _launch_head_epilogue(x, dpart, sqpart, base.contiguous(), scale.contiguous(),
                                 norm_weight.float().contiguous(), eps)
