"""One DSpark draft stage (`mtp.{i}`, dspark spec §7.2): a V4 block whose attention reads the
committed context through keys injected from the target's features.

A stage is a DeepSeek-V4 `Block` (mHC around a sliding-window attention and a score-routed MoE,
the same parameter names as a target layer) with one difference in attention (spec §1.2, §1.4):

    context keys   k_i = RoPE_i(kv_norm(wkv · main_x_i))     for committed positions i (K = V)
    block keys     k_j = RoPE_j(kv_norm(wkv · attn_norm(u_j)))   for the γ block rows j
    query of block row j (anchor position a) sees context i ∈ [a − W, a − 1] and every row of its
    own block (bidirectional inside the block), nothing else.

`main_x` enters only as keys/values; it never joins the residual. The MoE is score-routed, like the
MTP block's: the router kind of the shipped stages is unverified (spec §7.2), and hash routing by
token id would send every noise slot to the same experts. The query side is exactly V4's:
low-rank q with per-head RMS, partial RoPE on the last dims, per-head sink, inverse RoPE on the
output, grouped low-rank `wo_a` then `wo_b`.

The fused ops run through the kernel registry as in the target's `Block` (`stage_kernels.py`): the
three mHC sites (`mhc_pre`, `mhc_post_pre`, `mhc_post`), `sparse_attention`, `grouped_wo_a` and the
target's `MoE`, with the target's `KernelConfig`; under autograd (training) the torch references.
The norms and RoPE are the attention's and the stage's own `rms_norm` / `rope` ops (same config),
which run their references themselves when autograd records (an input or weight requires grad).

Context keys are a per-position quantity, so inference caches them per request (the draft state,
`dspark.draft.context`) and training computes them for a whole sequence; both then call
`DSparkStage.forward` with a key pool and an index telling each query which pool rows it sees.

Shape symbols: S block rows (γ per block), P context pool rows, W window, n_hc streams, D hidden,
H heads, d head_dim, G o_groups, R o_lora_rank, F number of target features.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.draft.stage_kernels import V4_SITES, StageKernels
from dspark.kernels import KernelConfig
from dspark.models.deepseek_v4.config import MOE, SLIDING
from dspark.models.deepseek_v4.mhc import hc_head
from dspark.models.deepseek_v4.model import Block
from dspark.models.deepseek_v4.norm import RMSNorm


def _hc_head_params(n_hc: int, dim: int, device) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """fp32 (fn [n_hc, n_hc·D], base [n_hc], scale [1]) of the final stream collapse."""
    return (nn.Parameter(torch.zeros(n_hc, n_hc * dim, dtype=torch.float32, device=device)),
            nn.Parameter(torch.zeros(n_hc, dtype=torch.float32, device=device)),
            nn.Parameter(torch.ones(1, dtype=torch.float32, device=device)))


def block_index(n_rows: int, gamma: int, pool_offset: int, device) -> torch.Tensor:
    """[S, γ] pool rows of each block row's own block: rows pool_offset + (j // γ)·γ + 0..γ−1."""
    first = torch.arange(n_rows, device=device) // gamma * gamma
    return pool_offset + first[:, None] + torch.arange(gamma, device=device)


class BlockRows:
    """The position-derived tensors of one `DSparkModel.blocks` call, built by the first stage that
    asks and reused by the others (every stage sees the same rows): the RoPE cos / sin of the rows'
    positions per Rope module (stages with equal tables share one module, `share_ropes`) and the
    own-block pool rows per context-pool length. In a CUDA-graph propose each build is a few tiny
    launches, ~36 of the drafter's 117 torch ops for three stages. Lives for one call.

    positions [S] long, rows grouped γ per block."""

    def __init__(self, positions: torch.Tensor, gamma: int):
        self.positions, self.gamma = positions, gamma
        self._memo: dict[tuple, object] = {}

    def cos_sin(self, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope.cos_sin(positions)`: ([S, rd/2], [S, rd/2]) fp32."""
        key = ("rope", id(rope))
        if key not in self._memo:
            self._memo[key] = rope.cos_sin(self.positions)
        return self._memo[key]

    def own_block(self, pool_offset: int) -> torch.Tensor:
        """`block_index` of the rows after a context pool of `pool_offset` rows: [S, γ]."""
        key = ("own", pool_offset)
        if key not in self._memo:
            self._memo[key] = block_index(self.positions.shape[0], self.gamma, pool_offset, self.positions.device)
        return self._memo[key]


def share_ropes(stages) -> None:
    """Point every stage whose RoPE table equals the first stage's at the first stage's module, so
    that `BlockRows` builds their cos / sin once (θ is a non-persistent buffer made from the config:
    checkpoints and state dicts are unaffected). Host-side, at construction."""
    first = stages[0].attn.rope
    for stage in stages[1:]:
        rope = stage.attn.rope
        if (rope.attention_factor == first.attention_factor and rope.inv_freq.shape == first.inv_freq.shape
                and torch.equal(rope.inv_freq, first.inv_freq)):
            stage.attn.rope = first


class DSparkStage(Block):
    """Draft stage i: a V4 block (`attn`, `ffn`, `attn_norm`, `ffn_norm`, `hc_attn_*`, `hc_ffn_*`).

    Stage 0 also owns the feature projection `main_proj` [D, F·D] and `main_norm` [D]; the last
    stage owns the output collapse `hc_head_{fn,base,scale}`, `norm`, and — attached by
    `DSparkModel` — `markov_head` and `confidence_head`. `config` is the target config with the
    stages' expert counts and window substituted. `kernels` is the target's kernel choice (default:
    the torch references); see `stage_kernels.py` for when the stage runs it.
    """

    def __init__(self, config, first: bool, last: bool, n_features: int, dtype=None, device=None,
                 kernels: KernelConfig | None = None):
        kernels = KernelConfig() if kernels is None else kernels
        super().__init__(config, SLIDING, MOE, dtype=dtype, device=device, kernels=kernels)
        self.stage_kernels = StageKernels(kernels, V4_SITES)
        d = config.hidden_size
        if first:
            self.main_proj = nn.Linear(n_features * d, d, bias=False, dtype=dtype, device=device)
            self.main_norm = RMSNorm(d, config.rms_norm_eps, device=device, kernels=kernels)
        if last:
            self.norm = RMSNorm(d, config.rms_norm_eps, device=device, kernels=kernels)
            self.hc_head_fn, self.hc_head_base, self.hc_head_scale = _hc_head_params(config.hc_mult, d, device)

    # ---------------------------------------------------------------------------------------
    # Context keys
    # ---------------------------------------------------------------------------------------

    def context_latents(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys (= values) of committed rows: main_x [n, D], positions [n] -> [n, d] (RoPE applied)."""
        attn = self.attn
        cos, sin = attn.rope.cos_sin(positions)
        return attn.norm_rope_op(attn.wkv(main_x), attn.kv_norm.weight, cos, sin, eps=attn.kv_norm.eps)

    # ---------------------------------------------------------------------------------------
    # Block forward
    # ---------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, ctx_pool: torch.Tensor,
                ctx_index: torch.Tensor, gamma: int, rows: BlockRows | None = None) -> torch.Tensor:
        """x [S, n_hc, D] block streams -> [S, n_hc, D].

        ids [S] block token ids (router input only for hash layers, which stages are not);
        positions [S] absolute positions of the block rows; ctx_pool [P, d] context keys;
        ctx_index [S, W] pool rows each query sees (−1 = none); rows are grouped γ per block;
        `rows` the call's shared `BlockRows` of those positions (None: built here).
        """
        ops = self.stage_kernels.current()
        rows = BlockRows(positions, gamma) if rows is None else rows
        post, comb, u = ops.pre(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, **self.mhc_eps)
        a = self._attend(ops, self.attn_norm(u), rows, ctx_pool, ctx_index)
        y, post, comb, v = ops.post_pre(a, x, post, comb, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
                                        **self.mhc_eps)
        moe = self.ffn.forward_ref if ops.reference else self.ffn
        return ops.post(moe(self.ffn_norm(v), ids), y, post, comb)

    def _attend(self, ops, x: torch.Tensor, rows: BlockRows, ctx_pool: torch.Tensor,
                ctx_index: torch.Tensor) -> torch.Tensor:
        """Attention of the block rows x [S, D] (after attn_norm) -> [S, D]."""
        attn = self.attn
        cos, sin = rows.cos_sin(attn.rope)  # [S, rd/2] fp32
        _, q, kv = attn.project_qkv(x, cos, sin)  # [S, H, d] (per-head RMS, as in the target), [S, d] block keys
        pool = torch.cat((ctx_pool.to(kv.dtype), kv))  # [P + S, d]
        index = torch.cat((ctx_index, rows.own_block(ctx_pool.shape[0])), dim=-1)  # [S, W + γ]
        out = ops.attend(q, pool, index, attn.attn_sink, attn.scale)  # [S, H, d]
        # inverse RoPE (undo the values' rotation) + block-diagonal wo_a -> [S, G·R], then wo_b
        return attn.wo_b(ops.wo_a(out, cos, sin, attn.wo_a.weight))

    # ---------------------------------------------------------------------------------------
    # Output (last stage)
    # ---------------------------------------------------------------------------------------

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        """Sigmoid-gated collapse of the streams, before `norm`: [S, n_hc, D] -> [S, D]."""
        return hc_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.hc_eps, self.norm_eps)
