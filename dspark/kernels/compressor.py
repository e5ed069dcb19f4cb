"""Compressor update (deepseek_v4 spec §8.2, deepseek_v41 spec §5.2): gated pooling + RMSNorm.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``compressor_pool_gather(kv_rows, score_rows, index, norm_weight, *, eps, out_dtype, cos_sin=None,
  out=None, out_rows=None) -> entries``: the same with each entry's slots named by row (`index`
  [n, slots] into [R, d] rows, −1 = empty): the static decode step pools straight from its rings
  instead of gathering copies first. Optionally the entries are rotated (`cos_sin`, the `rope` op's
  math) and stored at rows `out_rows` of `out` (the step's entry buffer): the kernel that normalises
  an entry writes it where it lives, instead of a RoPE launch and an `index_copy_` after the pool.
* ``compressor_pool(kv, score, norm_weight, *, eps, out_dtype) -> entries``: each complete group
  of `slots` rows (V4 HCA: 128 tokens; V4 CSA and its indexer: 2·4 overlapping half-rows; V4.1:
  2 tokens) becomes one entry RMSNorm(Σ_slots softmax_slots(score) ⊙ kv), per channel. The
  models assemble the slots (and add V4's position bias) before the call and apply RoPE after it.

Shape symbols: n entries, slots rows per entry, d entry width.

Fused kernel: one program per entry holds its [slots, d] logits and values (tiles of slots for
HCA's 128), keeps a running max / sum / weighted value per channel in fp32 (online softmax), rounds
the pooled row to `out_dtype` as the models store it, and normalises it in the same program: one
launch instead of softmax, product, sum, cast and norm. No host sync: CUDA-graph capturable.

A decode step pools one entry per request per compressor, too few programs to read HCA's 128 slots
quickly (one SM streaming [128, 512] rows took ~35 µs on an H200). With fewer entries than
`SPLIT_BELOW`, each entry's channels are split over programs (the softmax is per channel) that write
the rounded pooled row and their share of Σ pooled²; a second launch applies the norm.
"""

from __future__ import annotations

import torch

from dspark.kernels.compressor_ref import _check_args, _check_dest, _check_gather_args
from dspark.kernels.compressor_ref import compressor_pool_gather_ref, compressor_pool_ref  # noqa: F401 (the ops' refs)
from dspark.kernels.registry import require_triton

from dspark.kernels.triton_compat import jit as _jit, pdl_launch, pdl_prologue, tl, triton  # noqa: F401 (stand-ins without triton)


@_jit
def _pooled(kv_ptr, score_ptr, idx_ptr, e, n_slots, dim, offs_d, d_mask, BLOCK_SLOTS: tl.constexpr,
            GATHER: tl.constexpr):
    """Σ_slots softmax_slots(score) ⊙ kv of channels offs_d of entry e, fp32 (padded channels 0): a
    running max / sum / weighted value per channel over slot tiles (online softmax). Slot j of entry e
    is row e·slots + j of kv / score, or with GATHER row idx[e, j] (−1: empty, weight 0)."""
    m = tl.full(offs_d.shape, -1.0e30, tl.float32)  # finite: no inf − inf when every slot so far is empty
    l = tl.zeros(offs_d.shape, tl.float32)
    acc = tl.zeros(offs_d.shape, tl.float32)
    for s0 in range(0, n_slots, BLOCK_SLOTS):
        offs_s = s0 + tl.arange(0, BLOCK_SLOTS)
        s_ok = offs_s < n_slots
        if GATHER:
            rows = tl.load(idx_ptr + e * n_slots + offs_s, mask=s_ok, other=-1).to(tl.int64)
            s_ok = rows >= 0
        else:
            rows = e * n_slots + offs_s
        mask = s_ok[:, None] & d_mask[None, :]
        offs = rows[:, None] * dim + offs_d[None, :]
        score = tl.load(score_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        kv = tl.load(kv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(score, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new[None, :])  # empty slots (−inf): weight 0
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * kv, axis=0)
        m = m_new
    return acc / tl.where(d_mask, l, 1.0)  # padded channels: 0 / 1, not 0 / 0


@_jit
def _store_entry(out_ptr, row, out_stride, normed, offs_d, d_mask, cos_ptr, sin_ptr, e, dim, half,
                 D_PAD: tl.constexpr, ROPE: tl.constexpr):
    """Store entry e's normed channels (fp32, already rounded to out's dtype) at `row` of out; with ROPE
    its trailing 2·half channels are first rotated pairwise by cos/sin[e] [n, half] as the `rope` op
    does: (a, b) -> (a·c − b·s, a·s + b·c) in fp32, one rounding (launched without FMA contraction)."""
    if ROPE:
        even, odd = tl.split(tl.reshape(normed, (D_PAD // 2, 2)))  # channel pairs (2i, 2i+1)
        j = tl.arange(0, D_PAD // 2) - (dim // 2 - half)  # rotary pair index; < 0: a nope pair
        rot = (j >= 0) & (j < half)
        c = tl.load(cos_ptr + e * half + j, mask=rot, other=1.0)
        s = tl.load(sin_ptr + e * half + j, mask=rot, other=0.0)
        rotated = tl.join(tl.where(rot, even * c - odd * s, even), tl.where(rot, even * s + odd * c, odd))
        normed = tl.reshape(rotated, (D_PAD,))
    tl.store(out_ptr + row * out_stride + offs_d, normed.to(out_ptr.dtype.element_ty), mask=d_mask)


@_jit
def _entry_row(rows_ptr, e, SCATTER: tl.constexpr):
    """Destination row of entry e: rows[e] with SCATTER, else e."""
    if SCATTER:
        return tl.load(rows_ptr + e).to(tl.int64)
    return e


@_jit
def _pool_kernel(kv_ptr, score_ptr, idx_ptr, w_ptr, out_ptr, rows_ptr, cos_ptr, sin_ptr, n_slots, dim, half,
                 out_stride, eps, BLOCK_SLOTS: tl.constexpr, D_PAD: tl.constexpr, GATHER: tl.constexpr,
                 ROPE: tl.constexpr, SCATTER: tl.constexpr, PDL: tl.constexpr):
    """out[row(e)] = rope(w ⊙ RMS-normalised(round(Σ_slots softmax(score[e]) ⊙ kv[e]))) for entry e =
    program_id(0) (rope and row: `_store_entry`, `_entry_row`)."""
    pdl_prologue(PDL)
    e = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < dim
    pooled = _pooled(kv_ptr, score_ptr, idx_ptr, e, n_slots, dim, offs_d, d_mask, BLOCK_SLOTS, GATHER)
    pooled = pooled.to(out_ptr.dtype.element_ty).to(tl.float32)  # the stored entry's rounding
    rstd = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / dim + eps)
    w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0)
    normed = (w * pooled * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    _store_entry(out_ptr, _entry_row(rows_ptr, e, SCATTER), out_stride, normed, offs_d, d_mask, cos_ptr, sin_ptr,
                 e, dim, half, D_PAD, ROPE)


@_jit
def _pool_part_kernel(kv_ptr, score_ptr, idx_ptr, out_ptr, sq_ptr, n_slots, dim, n_dblocks,
                      BLOCK_SLOTS: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr):
    """Channels of block program_id(1) of entry e = program_id(0): out[e, block] = round(pooled),
    sq[e, block] = Σ_block round(pooled)² (the norm is `_norm_kernel`'s)."""
    pdl_prologue(PDL)
    e = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs_d = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < dim
    pooled = _pooled(kv_ptr, score_ptr, idx_ptr, e, n_slots, dim, offs_d, d_mask, BLOCK_SLOTS, GATHER)
    pooled = pooled.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + e * dim + offs_d, pooled, mask=d_mask)
    pooled = tl.where(d_mask, pooled.to(tl.float32), 0.0)
    tl.store(sq_ptr + e * n_dblocks + blk, tl.sum(pooled * pooled, axis=0))


@_jit
def _norm_kernel(src_ptr, sq_ptr, w_ptr, out_ptr, rows_ptr, cos_ptr, sin_ptr, n_dblocks, dim, half, out_stride,
                 eps, NB_PAD: tl.constexpr, D_PAD: tl.constexpr, ROPE: tl.constexpr, SCATTER: tl.constexpr,
                 PDL: tl.constexpr):
    """out[row(e)] = rope(w ⊙ src[e] / rms(src[e])) from the blocks' Σ pooled² (src: the rounded pooled
    rows; it may be out itself, in place: every store follows the row's reduction)."""
    pdl_prologue(PDL)
    e = tl.program_id(0).to(tl.int64)
    offs_b = tl.arange(0, NB_PAD)
    total = tl.sum(tl.load(sq_ptr + e * n_dblocks + offs_b, mask=offs_b < n_dblocks, other=0.0), axis=0)
    rstd = 1.0 / tl.sqrt(total / dim + eps)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < dim
    pooled = tl.load(src_ptr + e * dim + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0)
    normed = (w * pooled * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    _store_entry(out_ptr, _entry_row(rows_ptr, e, SCATTER), out_stride, normed, offs_d, d_mask, cos_ptr, sin_ptr,
                 e, dim, half, D_PAD, ROPE)


SPLIT_BELOW = 64  # entries per call under which channels are split over programs (module docstring)
_SPLIT_BLOCK_D = 64


def compressor_pool(kv: torch.Tensor, score: torch.Tensor, norm_weight: torch.Tensor, *, eps: float,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """Fused `compressor_pool_ref` (same signature, shapes and dtypes)."""
    return launch_compressor_pool(kv, score, norm_weight, eps=eps, out_dtype=out_dtype,
                                  split=kv.shape[0] < SPLIT_BELOW)


def compressor_pool_gather(kv_rows: torch.Tensor, score_rows: torch.Tensor, index: torch.Tensor,
                           norm_weight: torch.Tensor, *, eps: float, out_dtype: torch.dtype,
                           cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                           out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Fused `compressor_pool_gather_ref` (same signature): the slots are read through `index`; the
    rotation and the store at `out_rows` happen in the launch that normalises each entry."""
    require_triton()
    _check_gather_args(kv_rows, score_rows, index, norm_weight, eps, out_dtype)
    n, n_slots = index.shape
    _check_dest(n, kv_rows.shape[1], out_dtype, cos_sin, out, out_rows)
    return _launch(kv_rows, score_rows, index.contiguous(), norm_weight, n, n_slots, eps, out_dtype,
                   split=n < SPLIT_BELOW, cos_sin=cos_sin, out=out, out_rows=out_rows)


def launch_compressor_pool(kv: torch.Tensor, score: torch.Tensor, norm_weight: torch.Tensor, *, eps: float,
                           out_dtype: torch.dtype, split: bool) -> torch.Tensor:
    """`compressor_pool` with the launch chosen explicitly: one program per entry, or (`split`)
    channel blocks per entry and a norm launch (the tests run both on every shape)."""
    require_triton()
    _check_args(kv, score, norm_weight, eps, out_dtype)
    n, n_slots, dim = kv.shape
    return _launch(kv.reshape(n * n_slots, dim), score.reshape(n * n_slots, dim), None, norm_weight, n, n_slots,
                   eps, out_dtype, split)


def _launch(kv, score, index, norm_weight, n, n_slots, eps, out_dtype, split, cos_sin=None, out=None,
            out_rows=None):
    """Pool n entries of n_slots rows of kv / score [R, d] (rows e·slots + j, or index [n, slots]);
    rotate them by cos_sin ([n, rd/2] each) and store them at out[out_rows] ([R', d], [n]) when given."""
    dim = kv.shape[-1]
    if out is not None and out.stride(-1) != 1:
        raise ValueError(f"out must have contiguous rows, got strides {out.stride()}")
    if cos_sin is not None and (dim - 2 * cos_sin[0].shape[-1]) % 2:
        raise ValueError(f"the fused rotation needs an even number of unrotated channels, got d={dim}, "
                         f"rd={2 * cos_sin[0].shape[-1]}")
    dest = torch.empty((n, dim), dtype=out_dtype, device=kv.device) if out is None else out
    if n == 0:
        return dest
    kv, score, weight = kv.contiguous(), score.float().contiguous(), norm_weight.float().contiguous()
    gather, rope, scatter = index is not None, cos_sin is not None, out_rows is not None
    idx = index if gather else kv  # unused without GATHER (and likewise below)
    rows = out_rows.contiguous() if scatter else kv
    cos, sin = (t.float().contiguous() for t in cos_sin) if rope else (weight, weight)
    half = cos.shape[-1] if rope else 0
    d_pad = triton.next_power_of_2(dim)
    tail = dict(D_PAD=d_pad, ROPE=rope, SCATTER=scatter, num_warps=4 if d_pad >= 256 else 2,
                enable_fp_fusion=not rope)  # the rotation rounds as the `rope` op: no FMA
    if split:
        n_dblocks = triton.cdiv(dim, _SPLIT_BLOCK_D)
        pooled = dest if out is None else torch.empty((n, dim), dtype=out_dtype, device=kv.device)
        sq = torch.empty((n, n_dblocks), dtype=torch.float32, device=kv.device)
        pdl = pdl_launch(kv.device, n * n_dblocks)
        _pool_part_kernel[(n, n_dblocks)](kv, score, idx, pooled, sq, n_slots, dim, n_dblocks,
                                          BLOCK_SLOTS=max(1, min(triton.next_power_of_2(n_slots), 64)),
                                          BLOCK_D=_SPLIT_BLOCK_D, GATHER=gather, PDL=pdl, launch_pdl=pdl, num_warps=4)
        pdl = pdl_launch(kv.device, n)
        _norm_kernel[(n,)](pooled, sq, weight, dest, rows, cos, sin, n_dblocks, dim, half, dest.stride(0), float(eps),
                           NB_PAD=triton.next_power_of_2(n_dblocks), PDL=pdl, launch_pdl=pdl, **tail)
        return dest
    block_slots = max(1, min(triton.next_power_of_2(n_slots), 4096 // d_pad))  # [slots, d] tiles of <= 4K
    pdl = pdl_launch(kv.device, n)
    _pool_kernel[(n,)](kv, score, idx, weight, dest, rows, cos, sin, n_slots, dim, half, dest.stride(0), float(eps),
                       BLOCK_SLOTS=block_slots, GATHER=gather, PDL=pdl, launch_pdl=pdl, **tail)
    return dest
