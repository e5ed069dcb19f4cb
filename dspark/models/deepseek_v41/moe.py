"""The DeepSeek-V4.1 router (deepseek_v41 spec §7); experts and the MoE block are V4's.

    s       = sqrt(softplus(x·W_gᵀ / gate_temp))          [E] fp32
    experts = top-K of s + bias, with `bias_vl` instead of `bias` for image-span tokens
    g       = s[experts] / (Σ s[experts] + 1e-20) · routed_scaling_factor     (renormalised if K > 1)

No hash-routed layers. Same call signature as V4's `Gate`, so V4's `MoE` takes it as its `gate`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.deepseek_v4.moe import Gate as V4Gate


class Gate(V4Gate):
    """`weight` [E, D], `bias` [E] fp32 (text tokens), `bias_vl` [E] fp32 (image-span tokens)."""

    def __init__(self, config, dtype=None, device=None):
        super().__init__(config, hashed=False, dtype=dtype, device=device)
        self.gate_temp = config.gate_temp
        self.image_token_id = config.image_token_id
        self.bias_vl = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32, device=device))

    def fused_route_args(self, input_ids: torch.Tensor | None = None) -> dict | None:
        """V4's fused router computes this one where gate_temp is 1 and K > 1 (where this router
        renormalises, as `moe_route` always does). With an image-token id the selection bias is one
        row per token, `bias_vl` on image tokens (gate_bias [N, E], for `moe_route_rows`): given
        `input_ids` [N] only, else None (the module runs)."""
        if self.gate_temp != 1 or self.top_k == 1 or (self.image_token_id is not None and input_ids is None):
            return None
        args = super().fused_route_args()
        if self.image_token_id is not None:
            args["gate_bias"] = self._token_bias(input_ids)
        return args

    def _token_bias(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[N, E] fp32: `bias_vl` on the image-token rows, `bias` elsewhere (the forward's selection bias)."""
        return torch.where((input_ids == self.image_token_id).unsqueeze(-1), self.bias_vl, self.bias)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D], input_ids [N] -> (weights [N, K] fp32, expert ids [N, K] long)."""
        scores = self.score_fn(F.linear(x.float(), self.weight.float()) / self.gate_temp)  # [N, E]
        bias = self.bias if self.image_token_id is None else self._token_bias(input_ids)
        experts = (scores + bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        # With K = 1 the reference keeps the raw score (renormalising would make every weight 1).
        if self.renormalize and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts
