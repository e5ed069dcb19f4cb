"""Mixture of experts, present in every DeepSeek-V4 layer (spec §11).

    s       = score_fn(x·W_gᵀ)                      [E]   sqrt(softplus) for V4, in fp32
    experts = top-K of (s + bias)                          score layers ("moe": aux-loss-free bias
            | tid2eid[token id]                            steers selection only) or hash layers
    g       = s[experts] / Σ s[experts] · routed_scaling_factor
    y       = Σ_k g_k · Expert_{experts_k}(x) + Shared(x)

Every expert (routed and shared) is a SwiGLU clamped at `swiglu_limit`:
w2( silu(min(x·w1ᵀ, L)) ⊙ clamp(x·w3ᵀ, −L, L) ).

Shape symbols: N tokens, D hidden, E routed experts, K experts per token, I expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.deepseek_v4.config import DeepseekV4Config


def sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x)); softplus is the overflow-safe torch one. sqrtsoftplus(0) = 0.8325546."""
    return F.softplus(x).sqrt()


_SCORE_FUNCS = {"sqrtsoftplus": sqrtsoftplus, "sigmoid": torch.sigmoid, "softmax": lambda x: x.softmax(dim=-1)}


class Expert(nn.Module):
    """Clamped SwiGLU; w1, w3 [I, D], w2 [D, I]."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float, dtype=None, device=None):
        super().__init__()
        linear = dict(bias=False, dtype=dtype, device=device)
        self.w1 = nn.Linear(dim, inter_dim, **linear)
        self.w2 = nn.Linear(inter_dim, dim, **linear)
        self.w3 = nn.Linear(dim, inter_dim, **linear)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, D] -> [n, D]; the activation runs in fp32."""
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        return self.w2((F.silu(gate) * up).to(x.dtype))


class Gate(nn.Module):
    """Router. `weight` [E, D]; score layers have `bias` [E] fp32, hash layers a `tid2eid` [V, K] buffer."""

    def __init__(self, config: DeepseekV4Config, hashed: bool, dtype=None, device=None):
        super().__init__()
        c = config
        self.top_k = c.num_experts_per_tok
        self.hashed = hashed
        self.score_fn = _SCORE_FUNCS[c.scoring_func]
        self.renormalize = c.norm_topk_prob
        self.routed_scaling_factor = c.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size, dtype=dtype, device=device))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(c.vocab_size, c.num_experts_per_tok, dtype=torch.long,
                                                        device=device))
        else:
            self.bias = nn.Parameter(torch.zeros(c.n_routed_experts, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D], input_ids [N] -> (weights [N, K] fp32, expert ids [N, K] long)."""
        scores = self.score_fn(F.linear(x.float(), self.weight.float()))  # [N, E]
        if self.hashed:
            experts = self.tid2eid[input_ids]
        else:
            experts = (scores + self.bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        # The official code skips this for softmax scoring; HF 5.23 always renormalises. V4 configs
        # (sqrtsoftplus, norm_topk_prob=True) take the same path in all three.
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts


class MoE(nn.Module):
    """Routed experts + one shared expert; `gate`, `experts.{e}`, `shared_experts` (checkpoint names).

    `gate` replaces the V4 router by another one with the same call signature
    `(x [N, D], input_ids [N]) -> (weights [N, K], expert ids [N, K])` (DeepSeek-V4.1's adds a
    temperature and an image-token bias); `hashed` is then ignored.
    """

    def __init__(self, config: DeepseekV4Config, hashed: bool, dtype=None, device=None, gate: nn.Module | None = None):
        super().__init__()
        c = config
        self.gate = gate if gate is not None else Gate(c, hashed, dtype=dtype, device=device)
        self.experts = nn.ModuleList(
            Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, dtype=dtype, device=device)
            for _ in range(c.n_routed_experts)
        )
        self.shared_experts = Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [N, D] (after ffn_norm), input_ids [N] -> [N, D]. Routed outputs accumulate in fp32."""
        weights, experts = self.gate(x, input_ids)
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # Host loop over the experts that received tokens (one sync for the counts: reference path).
        counts = torch.bincount(experts.flatten(), minlength=len(self.experts)).tolist()
        for e, count in enumerate(counts):
            if count == 0:
                continue
            token, slot = torch.where(experts == e)
            y = self.experts[e](x[token]).float() * weights[token, slot].unsqueeze(-1)
            routed.index_add_(0, token, y)
        return (routed + self.shared_experts(x).float()).to(x.dtype)
