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

Parameter names equal the shipped keys: `attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink}`,
`ffn.{gate.{weight,bias,bias_vl},experts.E.w{1,2,3},shared_experts.w{1,2,3}}`, `attn_norm`,
`ffn_norm`, `hc_{attn,ffn}_{fn,base,scale}`; stage 0 adds `main_proj`, `main_norm`; the last stage
`norm` (and, attached by `DSparkModel`, `markov_head`, `confidence_head`).

Shape symbols: S block rows (γ per block), P context pool rows, W window, hc streams, D hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.draft.stages import block_index
from dspark.models.deepseek_v4.attention import sparse_attention
from dspark.models.deepseek_v4.mhc import collapse, hc_post
from dspark.models.deepseek_v4.norm import RMSNorm
from dspark.models.deepseek_v4.rope import apply_rope
from dspark.models.deepseek_v41.block import Block
from dspark.models.deepseek_v41.qat import CacheQuant
from dspark.models.deepseek_v41.roles import SWA, LayerRole


def stage_role(stage: int, num_hidden_layers: int) -> LayerRole:
    """The role of stage `stage`: a ratio-0 SWA layer (after the backbone's layers), no Engram."""
    return LayerRole(layer_id=num_hidden_layers + stage, kind=SWA, ratio=0, kv_source=None, index_source=None,
                     is_candidate_source=False, uses_candidates=False, has_engram=False)


class DSparkStageV41(Block):
    """Draft stage i of a V4.1 checkpoint. `config` is the target's `DeepseekV41Config` with the
    stages' expert counts and window substituted; `cache_qat` as the target's (FP8 window latents)."""

    carries_pre = True  # `DSparkModel` threads the pre-mix through the stages

    def __init__(self, config, index: int, first: bool, last: bool, n_features: int, cache_qat: bool = True,
                 dtype=None, device=None):
        super().__init__(config, stage_role(index, config.num_hidden_layers), CacheQuant(cache_qat), dtype=dtype,
                         device=device)
        d = config.hidden_size
        if first:
            self.main_proj = nn.Linear(n_features * d, d, bias=False, dtype=dtype, device=device)
            self.main_norm = RMSNorm(d, config.rms_norm_eps, device=device)
        if last:
            self.norm = RMSNorm(d, config.rms_norm_eps, device=device)

    def context_latents(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys (= values) of committed rows: main_x [n, D], positions [n] -> [n, d] (RoPE, FP8 QAT)."""
        attn = self.attn
        cos, sin = attn.rope.cos_sin(positions)
        return attn.quant.window(apply_rope(attn.kv_norm(attn.wkv(main_x)), cos, sin))

    def forward(self, x: torch.Tensor, pre: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                ctx_pool: torch.Tensor, ctx_index: torch.Tensor, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, hc, D] block streams, carried pre [S, hc] fp32 -> (streams [S, hc, D], FFN pre [S, hc]).

        ids [S] block token ids (router input for `bias_vl`); positions [S]; ctx_pool [P, d] context
        keys; ctx_index [S, W] pool rows each query sees (−1 = none); rows grouped γ per block.
        """
        a_pre, a_post, a_comb = self._mixes(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        a = self._attend(self.attn_input(x, pre), positions, ctx_pool, ctx_index, gamma)
        y = hc_post(a, x, a_post, a_comb)
        f_pre, f_post, f_comb = self._mixes(y, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        f = self.ffn(self.ffn_norm(collapse(y, a_pre)), ids)
        return hc_post(f, y, f_post, f_comb), f_pre

    def _attend(self, x: torch.Tensor, positions: torch.Tensor, ctx_pool: torch.Tensor, ctx_index: torch.Tensor,
                gamma: int) -> torch.Tensor:
        """Attention of the block rows x [S, D] (after attn_norm) -> [S, D]."""
        attn = self.attn
        cos, sin = attn.rope.cos_sin(positions)
        _, q, kv = attn.project_qkv(x, cos, sin)  # no per-head q norm (V4.1)
        kv = attn.quant.window(kv)  # block keys, transient, rounded like the window cache
        pool = torch.cat((ctx_pool.to(kv.dtype), kv))  # [P + S, d]
        index = torch.cat((ctx_index, block_index(x.shape[0], gamma, ctx_pool.shape[0], x.device)), dim=-1)
        return attn.project_out(sparse_attention(q, pool, index, attn.attn_sink, attn.scale), cos, sin)

    def collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The output collapse before `norm` with the last FFN pre: [S, hc, D], [S, hc] -> [S, D]."""
        return collapse(x, pre)
