"""Compressor update (deepseek_v4 spec §8.2, deepseek_v41 spec §5.2): gated pooling + RMSNorm.

Op (`<op>` is Triton, `<op>_ref` is torch, same signature):

* ``compressor_pool(kv, score, norm_weight, *, eps, out_dtype) -> entries``: each complete group
  of `slots` rows (V4 HCA: 128 tokens; V4 CSA and its indexer: 2·4 overlapping half-rows; V4.1:
  2 tokens) becomes one entry RMSNorm(Σ_slots softmax_slots(score) ⊙ kv), per channel. The
  models assemble the slots (and add V4's position bias) before the call and apply RoPE after it.

Shape symbols: n entries, slots rows per entry, d entry width.

Fused kernel: one program per entry holds its [slots, d] logits and values (tiles of slots for
HCA's 128), keeps a running max / sum / weighted value per channel in fp32 (online softmax), rounds
the pooled row to `out_dtype` as the models store it, and normalises it in the same program: one
launch instead of softmax, product, sum, cast and norm. No host sync: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from dspark.kernels.compressor_ref import _check_args, compressor_pool_ref  # noqa: F401 (the op's ref)
from dspark.kernels.registry import require_triton

from dspark.kernels.triton_compat import jit as _jit, tl, triton  # noqa: F401 (stand-ins without triton)


@_jit
def _pool_kernel(kv_ptr, score_ptr, w_ptr, out_ptr, n_slots, dim, eps,
                 BLOCK_SLOTS: tl.constexpr, D_PAD: tl.constexpr):
    """out[e] = w ⊙ RMS-normalised(round(Σ_slots softmax(score[e]) ⊙ kv[e])) for entry e = program_id(0)."""
    e = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < dim
    m = tl.full((D_PAD,), -1.0e30, tl.float32)  # finite: no inf − inf when every slot so far is empty
    l = tl.zeros((D_PAD,), tl.float32)
    acc = tl.zeros((D_PAD,), tl.float32)
    base = e * n_slots * dim
    for s0 in range(0, n_slots, BLOCK_SLOTS):
        offs_s = s0 + tl.arange(0, BLOCK_SLOTS)
        mask = (offs_s < n_slots)[:, None] & d_mask[None, :]
        offs = base + offs_s[:, None] * dim + offs_d[None, :]
        score = tl.load(score_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        kv = tl.load(kv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(score, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(score - m_new[None, :])  # empty slots (−inf): weight 0
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * kv, axis=0)
        m = m_new
    l = tl.where(d_mask, l, 1.0)  # padded channels: 0 / 1, not 0 / 0
    pooled = (acc / l).to(out_ptr.dtype.element_ty).to(tl.float32)  # the stored entry's rounding
    rstd = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / dim + eps)
    w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0)
    tl.store(out_ptr + e * dim + offs_d, (w * pooled * rstd).to(out_ptr.dtype.element_ty), mask=d_mask)


def compressor_pool(kv: torch.Tensor, score: torch.Tensor, norm_weight: torch.Tensor, *, eps: float,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """Fused `compressor_pool_ref` (same signature, shapes and dtypes)."""
    require_triton()
    _check_args(kv, score, norm_weight, eps, out_dtype)
    n, n_slots, dim = kv.shape
    out = torch.empty((n, dim), dtype=out_dtype, device=kv.device)
    if n == 0:
        return out
    d_pad = triton.next_power_of_2(dim)
    block_slots = max(1, min(triton.next_power_of_2(n_slots), 4096 // d_pad))  # [slots, d] tiles of <= 4K
    _pool_kernel[(n,)](kv.contiguous(), score.float().contiguous(), norm_weight.float().contiguous(), out,
                       n_slots, dim, float(eps), BLOCK_SLOTS=block_slots, D_PAD=d_pad,
                       num_warps=4 if d_pad >= 256 else 2)
    return out
