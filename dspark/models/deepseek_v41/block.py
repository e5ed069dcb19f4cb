"""One DeepSeek-V4.1 layer with single-pass mHC (deepseek_v41 spec §4).

V4 computes each site's (pre, post, comb) from the site's own input and collapses with that pre.
V4.1 computes all three from the site's input too, but collapses with the pre *carried from the
previous site*, and hands its own pre to the next site:

    (A_pre, A_post, A_comb) = Mix(X; hc_attn)                    X: streams after any Engram
    a  = Attn(attn_norm(Σ_k P_in[k] · X_k))                      P_in: the previous layer's F_pre
    Y  = A_post ⊗ a + A_combᵀ · X
    (F_pre, F_post, F_comb) = Mix(Y; hc_ffn)
    f  = MoE(ffn_norm(Σ_k A_pre[k] · Y_k))
    X' = F_post ⊗ f + F_combᵀ · Y                                returns (X', F_pre)

Mix is V4's (`stream_mixes` + `split_mixes`: RMS statistic with `rms_norm_eps` = 1e-20, sigmoid
pre/post, Sinkhorn comb). Layer 0 starts from a one-hot pre on stream 0 (its attention input is
exactly the embedding), and the model's final collapse uses the last F_pre: there is no `hc_head`.

Shape symbols: N tokens, hc streams, D hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.kernels import KernelConfig, get_op
from dspark.models.deepseek_v4.mhc import collapse, hc_post, split_mixes, stream_mixes
from dspark.models.deepseek_v4.moe import MoE
from dspark.models.deepseek_v4.norm import RMSNorm
from dspark.models.deepseek_v4.state import RaggedBatch, WindowCache
from dspark.models.deepseek_v41.attention import Attention
from dspark.models.deepseek_v41.csa2 import SharedSlots
from dspark.models.deepseek_v41.engram import Engram
from dspark.models.deepseek_v41.moe import Gate
from dspark.models.deepseek_v41.qat import CacheQuant
from dspark.models.deepseek_v41.roles import LayerRole
from dspark.models.deepseek_v41.state import SourceCache


def initial_pre(n: int, n_hc: int, device) -> torch.Tensor:
    """The carried mix before layer 0: one-hot on stream 0, fp32 [n, n_hc]."""
    pre = torch.zeros(n, n_hc, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre


class Block(nn.Module):
    """Parameters (checkpoint names): `attn`, `ffn` (V4's MoE with the V4.1 `Gate`), `attn_norm`,
    `ffn_norm`, `hc_{attn,ffn}_{fn [(2+hc)·hc, hc·D], base [(2+hc)·hc], scale [3]}` (fp32), and
    `engram` on Engram layers (the model applies it before the layer, see `model.py`).

    `kernels` (default: torch references) picks the implementations of the registry's ops: the
    attention site is `mhc_v41_pre` (Mix + collapse with the carried pre + attn_norm), the FFN site
    `mhc_v41_post_pre` (the attention post, then the same on Y), the closing post `mhc_post` (its
    reference is V4's `hc_post`). The references are this docstring's torch dataflow, op for op."""

    def __init__(self, config, role: LayerRole, quant: CacheQuant = CacheQuant(), dtype=None, device=None,
                 host_engram: bool = False, kernels: KernelConfig | None = None):
        super().__init__()
        c = config
        kernels = KernelConfig() if kernels is None else kernels
        self.hc_post = get_op(kernels, "mhc_post") if kernels.mhc_post == "triton" else hc_post
        self.pre_op = get_op(kernels, "mhc_v41_pre")
        self.post_pre_op = get_op(kernels, "mhc_v41_post_pre")
        self.role = role
        self.n_hc = c.hc_mult
        self.sinkhorn_iters = c.hc_sinkhorn_iters
        self.hc_eps = c.hc_eps
        self.norm_eps = c.rms_norm_eps
        self.engram = None
        if role.has_engram:
            rows = c.engram_num_embeddings[c.engram_layer_ids.index(role.layer_id)]
            self.engram = Engram(c, rows, dtype=dtype, device=device, host_table=host_engram)
        self.attn = Attention(c, role, quant, dtype=dtype, device=device, kernels=kernels)
        self.ffn = MoE(c, hashed=False, dtype=dtype, device=device, gate=Gate(c, dtype=dtype, device=device),
                       kernels=kernels)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device)
        n_mix, width = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.hidden_size  # [pre | post | comb] mixes
        fp32 = dict(dtype=torch.float32, device=device)
        self.hc_attn_fn = nn.Parameter(torch.zeros(n_mix, width, **fp32))
        self.hc_attn_base = nn.Parameter(torch.zeros(n_mix, **fp32))
        self.hc_attn_scale = nn.Parameter(torch.ones(3, **fp32))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(n_mix, width, **fp32))
        self.hc_ffn_base = nn.Parameter(torch.zeros(n_mix, **fp32))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3, **fp32))

    def attn_input(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """x [N, hc, D], carried pre [N, hc] -> the attention input attn_norm(Σ_k pre_k X_k) [N, D]."""
        return self.attn_norm(collapse(x, pre))

    def forward(self, x: torch.Tensor, pre: torch.Tensor, batch: RaggedBatch, windows: list[WindowCache],
                sources: list[SourceCache | None], slots: list[SharedSlots],
                publish: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hc, D], carried pre [N, hc] fp32 -> (streams [N, hc, D], this layer's FFN pre [N, hc])."""
        eps = dict(rms_eps=self.norm_eps, hc_eps=self.hc_eps, sinkhorn_iters=self.sinkhorn_iters)
        a_pre, a_post, a_comb, h = self.pre_op(x, pre, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                                               self.attn_norm.weight, norm_eps=self.attn_norm.eps, **eps)
        a = self.attn(h, batch, windows, sources, slots, publish)
        y, f_pre, f_post, f_comb, g = self.post_pre_op(a, x, a_post, a_comb, a_pre, self.hc_ffn_fn, self.hc_ffn_base,
                                                       self.hc_ffn_scale, self.ffn_norm.weight,
                                                       norm_eps=self.ffn_norm.eps, **eps)
        f = self.ffn(g, batch.input_ids)
        return self.hc_post(f, y, f_post, f_comb), f_pre

    def _mixes(self, x, fn, base, scale):
        return split_mixes(stream_mixes(x, fn, self.norm_eps), scale, base, self.n_hc, self.sinkhorn_iters,
                           self.hc_eps)
