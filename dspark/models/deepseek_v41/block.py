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

from typing import NamedTuple

import torch
from torch import nn

from dspark.kernels import KernelConfig, get_op
from dspark.models.deepseek_v4.mhc import collapse
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


class Site(NamedTuple):
    """An mHC site whose sublayer has not run yet: its own mixes from its input streams, and the
    sublayer input collapsed with the carried pre.

    pre, post [N, hc] fp32 (pre goes to the next site), comb [N, hc, hc] fp32, h [N, D] = the
    normed sublayer input.
    """

    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    h: torch.Tensor


class PendingPost(NamedTuple):
    """The FFN site's post not yet applied (X' = post ⊗ f + combᵀ·Y) and its pre, carried onward.

    f [N, D] the MoE output, post [N, hc], comb [N, hc, hc], pre [N, hc] fp32.
    """

    f: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    pre: torch.Tensor


class Block(nn.Module):
    """Parameters (checkpoint names): `attn`, `ffn` (V4's MoE with the V4.1 `Gate`), `attn_norm`,
    `ffn_norm`, `hc_{attn,ffn}_{fn [(2+hc)·hc, hc·D], base [(2+hc)·hc], scale [3]}` (fp32), and
    `engram` on Engram layers (the model applies it before the layer, see `model.py`).

    `kernels` (default: torch references) picks the implementations of the registry's ops: the
    attention site is `mhc_v41_pre` (Mix + collapse with the carried pre + attn_norm), the FFN site
    `mhc_v41_post_pre` (the attention post, then the same on Y), the closing post `mhc_post`. The
    references are this docstring's torch dataflow, op for op (`mhc_post_ref` is V4's `hc_post`).

    `forward` runs the block closed. The model may instead leave the closing post pending (`open`)
    and apply it with the next block's `enter`, one `mhc_v41_post_pre` for the boundary (spec §4:
    "deferral of hc_ffn.post into the next layer's entry")."""

    def __init__(self, config, role: LayerRole, quant: CacheQuant = CacheQuant(), dtype=None, device=None,
                 host_engram: bool = False, kernels: KernelConfig | None = None):
        super().__init__()
        c = config
        kernels = KernelConfig() if kernels is None else kernels
        self.post_op = get_op(kernels, "mhc_post")
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
            self.engram = Engram(c, rows, dtype=dtype, device=device, host_table=host_engram, kernels=kernels)
        self.attn = Attention(c, role, quant, dtype=dtype, device=device, kernels=kernels)
        self.ffn = MoE(c, hashed=False, dtype=dtype, device=device, gate=Gate(c, dtype=dtype, device=device),
                       kernels=kernels)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, kernels=kernels)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, kernels=kernels)
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
        """The block closed: x [N, hc, D], carried pre [N, hc] fp32 -> (streams [N, hc, D], this
        layer's FFN pre [N, hc])."""
        y, pending = self.open(x, self.attn_site(x, pre), batch, windows, sources, slots, publish)
        return self.close(pending, y), pending.pre

    def attn_site(self, x: torch.Tensor, pre: torch.Tensor, mixes_on=None) -> Site:
        """The attention site on input streams x [N, hc, D] with the carried pre [N, hc] fp32.
        `mixes_on`: where the fused site op launches its mixes (`mhc_v41._launch_epilogue`; the
        static step's side stream, joined before the next site reads them)."""
        return Site(*self.pre_op(x, pre, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                                 self.attn_norm.weight, norm_eps=self.attn_norm.eps, mixes_on=mixes_on,
                                 **self._eps()))

    def enter(self, pending: PendingPost, y: torch.Tensor, mixes_on=None) -> tuple[torch.Tensor, Site]:
        """The previous block's pending post on its streams y [N, hc, D] fused with this block's
        attention site (carried pre: `pending.pre`), one op. Returns (this block's input streams
        [N, hc, D], its Site). `mixes_on` as `attn_site`'s."""
        x, *site = self.post_pre_op(pending.f, y, pending.post, pending.comb, pending.pre, self.hc_attn_fn,
                                    self.hc_attn_base, self.hc_attn_scale, self.attn_norm.weight,
                                    norm_eps=self.attn_norm.eps, mixes_on=mixes_on, **self._eps())
        return x, Site(*site)

    def open(self, x: torch.Tensor, site: Site, batch: RaggedBatch, windows: list[WindowCache],
             sources: list[SourceCache | None], slots: list[SharedSlots],
             publish: bool = True) -> tuple[torch.Tensor, PendingPost]:
        """Attention, its post fused with the FFN site, MoE; the FFN's post left pending.

        x [N, hc, D] the block's input streams, `site` their attention site. Returns (Y [N, hc, D]
        after the attention's post, the FFN site's PendingPost on Y).
        """
        return self.ffn_after(self.attn(site.h, batch, windows, sources, slots, publish), x, site, batch.input_ids)

    def ffn_after(self, a: torch.Tensor, x: torch.Tensor, site: Site, input_ids: torch.Tensor,
                  mixes_on=None) -> tuple[torch.Tensor, PendingPost]:
        """Everything of `open` after the attention: its post fused with the FFN site, then MoE.

        a [N, D] the attention output, x [N, hc, D] the block's input streams, `site` their attention
        site, input_ids [N] (the router's image-token bias). Split out so that another attention
        driver (the static decode step, `static_step.py`) runs the same block. `mixes_on` as
        `attn_site`'s (for the FFN site's mixes).
        """
        y, f_pre, f_post, f_comb, g = self.post_pre_op(a, x, site.post, site.comb, site.pre, self.hc_ffn_fn,
                                                       self.hc_ffn_base, self.hc_ffn_scale, self.ffn_norm.weight,
                                                       norm_eps=self.ffn_norm.eps, mixes_on=mixes_on, **self._eps())
        return y, PendingPost(self.ffn(g, input_ids), f_post, f_comb, f_pre)

    def close(self, pending: PendingPost, y: torch.Tensor) -> torch.Tensor:
        """Apply the pending post alone: y [N, hc, D] -> the next block's input streams [N, hc, D]."""
        return self.post_op(pending.f, y, pending.post, pending.comb)

    def _eps(self) -> dict:
        return dict(rms_eps=self.norm_eps, hc_eps=self.hc_eps, sinkhorn_iters=self.sinkhorn_iters)
