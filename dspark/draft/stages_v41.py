"""One DSpark draft stage of a DeepSeek-V4.1 checkpoint as shipped (`mtp.{i}`, deepseek_v41 spec §9).

The released V4.1 stages are V4.1 blocks, not V4 ones (compare `stages.py`):

* single-pass mHC: each sublayer collapses with the pre-mix *carried* from the previous site and
  hands its own on; stage 0 starts from the one-hot pre on stream 0, stage s > 0 from stage s−1's
  FFN pre, and the last stage's FFN pre collapses the output (no `hc_head_*`);
* attention is V4.1's ratio-0 (SWA-only) core: main RoPE, no per-head q norm, FP8-rounded window
  latents (the target's cache QAT), keys = context latents `kv_norm(wkv · main_x)` of the committed
  window plus the block's own rows (bidirectional inside the block);
* the MoE uses the V4.1 `Gate` (sqrt-softplus with `gate_temp`, `bias` / `bias_vl`); no Engram,
  no compressor, no indexer.

The fused ops run through the kernel registry as in the target's V4.1 `Block` (`stage_kernels.py`):
the mHC sites (`mhc_v41_pre`, `mhc_v41_post_pre`, `mhc_post`), `sparse_attention`, `grouped_wo_a`
and the MoE, with the target's `KernelConfig`; under autograd the torch references.

Parameter names equal the shipped keys: `attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink}`,
`ffn.{gate.{weight,bias,bias_vl},experts.E.w{1,2,3},shared_experts.w{1,2,3}}`, `attn_norm`,
`ffn_norm`, `hc_{attn,ffn}_{fn,base,scale}`; stage 0 adds `main_proj`, `main_norm`; the last stage
`norm` (and, attached by `DSparkModel`, `markov_head`, `confidence_head`).

Shape symbols: S block rows (γ per block), P context pool rows, W window, hc streams, D hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.draft.stage_kernels import V41_SITES, StageKernels
from dspark.draft.stages import BlockRows
from dspark.kernels import KernelConfig
from dspark.models.deepseek_v4.mhc import collapse
from dspark.models.deepseek_v4.norm import RMSNorm
from dspark.models.deepseek_v41.block import Block
from dspark.models.deepseek_v41.qat import CacheQuant
from dspark.models.deepseek_v41.roles import SWA, LayerRole


def stage_role(stage: int, num_hidden_layers: int) -> LayerRole:
    """The role of stage `stage`: a ratio-0 SWA layer (after the backbone's layers), no Engram."""
    return LayerRole(layer_id=num_hidden_layers + stage, kind=SWA, ratio=0, kv_source=None, index_source=None,
                     is_candidate_source=False, uses_candidates=False, has_engram=False)


class DSparkStageV41(Block):
    """Draft stage i of a V4.1 checkpoint. `config` is the target's `DeepseekV41Config` with the
    stages' expert counts and window substituted; `cache_qat` as the target's (FP8 window latents);
    `kernels` the target's kernel choice (default: the torch references, see `stage_kernels.py`)."""

    carries_pre = True  # `DSparkModel` threads the pre-mix through the stages

    def __init__(self, config, index: int, first: bool, last: bool, n_features: int, cache_qat: bool = True,
                 dtype=None, device=None, kernels: KernelConfig | None = None):
        kernels = KernelConfig() if kernels is None else kernels
        super().__init__(config, stage_role(index, config.num_hidden_layers), CacheQuant(cache_qat), dtype=dtype,
                         device=device, kernels=kernels)
        self.stage_kernels = StageKernels(kernels, V41_SITES)
        d = config.hidden_size
        if first:
            self.main_proj = nn.Linear(n_features * d, d, bias=False, dtype=dtype, device=device)
            self.main_norm = RMSNorm(d, config.rms_norm_eps, device=device, kernels=kernels)
        if last:
            self.norm = RMSNorm(d, config.rms_norm_eps, device=device, kernels=kernels)

    def context_latents(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys (= values) of committed rows: main_x [n, D], positions [n] -> [n, d] (RoPE, FP8 QAT)."""
        attn = self.attn
        cos, sin = attn.rope.cos_sin(positions)
        return attn.quant.window(attn.rope_op(attn.kv_norm(attn.wkv(main_x)), cos, sin))

    def forward(self, x: torch.Tensor, pre: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                ctx_pool: torch.Tensor, ctx_index: torch.Tensor, gamma: int,
                rows: BlockRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, hc, D] block streams, carried pre [S, hc] fp32 -> (streams [S, hc, D], FFN pre [S, hc]).

        ids [S] block token ids (router input for `bias_vl`); positions [S]; ctx_pool [P, d] context
        keys; ctx_index [S, W] pool rows each query sees (−1 = none); rows grouped γ per block.
        """
        ops = self.stage_kernels.current()
        # attention site: own mixes of x, input attn_norm(Σ_k pre_k x_k) with the carried pre
        a_pre, a_post, a_comb, h = ops.pre(x, pre, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                                           self.attn_norm.weight, norm_eps=self.attn_norm.eps, **self._eps())
        a = self._attend(ops, h, BlockRows(positions, gamma) if rows is None else rows, ctx_pool, ctx_index)
        # attention post, then the FFN site on Y (collapsed with the attention site's pre)
        y, f_pre, f_post, f_comb, g = ops.post_pre(a, x, a_post, a_comb, a_pre, self.hc_ffn_fn, self.hc_ffn_base,
                                                   self.hc_ffn_scale, self.ffn_norm.weight,
                                                   norm_eps=self.ffn_norm.eps, **self._eps())
        moe = self.ffn.forward_ref if ops.reference else self.ffn
        return ops.post(moe(g, ids), y, f_post, f_comb), f_pre

    def _attend(self, ops, x: torch.Tensor, rows: BlockRows, ctx_pool: torch.Tensor,
                ctx_index: torch.Tensor) -> torch.Tensor:
        """Attention of the block rows x [S, D] (after attn_norm) -> [S, D]."""
        attn = self.attn
        cos, sin = rows.cos_sin(attn.rope)
        _, q, kv = attn.project_qkv(x, cos, sin)  # no per-head q norm (V4.1)
        kv = attn.quant.window(kv)  # block keys, transient, rounded like the window cache
        pool = torch.cat((ctx_pool.to(kv.dtype), kv))  # [P + S, d]
        index = torch.cat((ctx_index, rows.own_block(ctx_pool.shape[0])), dim=-1)
        out = ops.attend(q, pool, index, attn.attn_sink, attn.scale)  # [S, H, d]
        return attn.wo_b(ops.wo_a(out, cos, sin, attn.wo_a.weight))  # inverse RoPE, grouped wo_a, wo_b

    def collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The output collapse before `norm` with the last FFN pre: [S, hc, D], [S, hc] -> [S, D]."""
        return collapse(x, pre)
