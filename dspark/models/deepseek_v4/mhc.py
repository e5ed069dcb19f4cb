"""Manifold-constrained hyper-connections, mHC (spec §6), as pure functions in fp32.

The residual is `n_hc` parallel streams X [N, n_hc, D]. Around each sublayer (attention, MoE):

    (pre, post, comb) = split(RMS(flatten X) · fnᵀ)          # one [n_hc·(2+n_hc)]-wide mix per token
    u  = Σ_k pre_k · X_k                                      # the sublayer input       [N, D]
    X' = post ⊗ f(u) + combᵀ · X                              # f(u): the sublayer output [N, D]

with `pre = σ(·) + eps`, `post = 2σ(·)` and `comb` a Sinkhorn-projected (≈ doubly stochastic)
n_hc×n_hc matrix. The parameters live on the block under their checkpoint names
(`hc_attn_fn/base/scale`, `hc_ffn_*`) and are passed in; the final collapse `hc_head` uses only a
`pre`-style mix. Everything here runs in fp32 and casts to the residual dtype at the end.

Shape symbols: N tokens, H = n_hc streams, D hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.models.deepseek_v4.norm import rms_scale


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project [..., H, H] logits towards a doubly stochastic matrix (spec §6.2 steps 7-8).

    Row softmax (+eps), one column normalisation, then `iters − 1` (row, column) rounds; every
    denominator gets +eps. Columns sum to 1 − O(eps) on exit, rows only approximately. fp32 in/out.
    """
    comb = logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def split_mixes(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n_hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn raw mixes [..., (2+H)·H] into (pre [..., H], post [..., H], comb [..., H, H]), fp32.

    Layout of the mix vector and of `base`: [pre (H) | post (H) | comb (H·H, row-major)];
    `scale` [3] multiplies the three groups.
    """
    pre_m, post_m, comb_m = mixes.float().split([n_hc, n_hc, n_hc * n_hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n_hc, n_hc, n_hc * n_hc])
    scale = scale.float()
    pre = torch.sigmoid(pre_m * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_m * scale[1] + post_b)
    comb_logits = (comb_m * scale[2] + comb_b).unflatten(-1, (n_hc, n_hc))
    return pre, post, sinkhorn(comb_logits, iters, eps)


def stream_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """RMS-normalised flattened streams times fnᵀ: x [N, H, D], fn [M, H·D] -> [N, M] fp32."""
    return F.linear(rms_scale(x.flatten(-2), norm_eps), fn.float())


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_k pre_k · X_k in fp32, cast to x's dtype: x [N, H, D], pre [N, H] -> [N, D]."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=-2).to(x.dtype)


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    n_hc: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC before a sublayer: x [N, H, D] -> (sublayer input [N, D], post [N, H], comb [N, H, H])."""
    pre, post, comb = split_mixes(stream_mixes(x, fn, norm_eps), scale, base, n_hc, iters, hc_eps)
    return collapse(x, pre), post, comb


def hc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC after a sublayer: X'_k = post_k · f + Σ_j comb[j, k] · X_j, in fp32, cast to x's dtype.

    f [N, D] sublayer output, x [N, H, D] its residual streams. comb is not symmetric: the sum runs
    over its *first* index.
    """
    mixed = torch.einsum("njk,njd->nkd", comb, x.float())
    return (post.unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(x.dtype)


def hc_head(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """Final collapse of the streams (spec §6.4): x [N, H, D] -> [N, D]; fn [H, H·D], base [H], scale [1]."""
    pre = torch.sigmoid(stream_mixes(x, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return collapse(x, pre)
