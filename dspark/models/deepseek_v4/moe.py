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

from dspark.kernels import KernelConfig, get_op
from dspark.models.deepseek_v4.config import DeepseekV4Config

_EXPERT_WEIGHTS = ("w1", "w2", "w3")


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

    def fused_route_args(self, input_ids: torch.Tensor | None = None) -> dict | None:
        """The arguments besides (x, gate_weight, token_ids) with which the registry's `moe_route`
        computes this router, or None where it cannot (another score function, no renormalising).
        `input_ids` [N] is for gates whose bias depends on the token (V4.1's: `moe_route_rows`)."""
        if self.score_fn is not sqrtsoftplus or not self.renormalize:
            return None
        return dict(gate_bias=None if self.hashed else self.bias, tid2eid=self.tid2eid if self.hashed else None,
                    top_k=self.top_k, routed_scaling_factor=self.routed_scaling_factor, hash_routing=self.hashed)

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

    `kernels` picks the implementation (default: the torch reference below). With
    ``kernels.fused_moe == "triton"`` the layer runs the registry's `moe_route` (where it computes
    the gate: `Gate.fused_route_args`; else the gate module runs) and `moe_experts` ops. Those read
    the routed experts as stacked [E, I, D] / [E, D, I] tensors: every `experts.{e}.w*.weight` is a
    view into one stacked tensor per projection, so the checkpoint names and the per-expert modules
    stay as they are, and no weight is copied per call.
    """

    def __init__(self, config: DeepseekV4Config, hashed: bool, dtype=None, device=None, gate: nn.Module | None = None,
                 kernels: KernelConfig | None = None):
        super().__init__()
        c = config
        kernels = KernelConfig() if kernels is None else kernels
        if not isinstance(kernels, KernelConfig):
            raise ValueError(f"kernels must be a KernelConfig, got {kernels!r}")
        self.gate = gate if gate is not None else Gate(c, hashed, dtype=dtype, device=device)
        # Built on the meta device, then pointed at slices of the stacked weights (no double allocation).
        self.experts = nn.ModuleList(
            Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, dtype=dtype, device="meta")
            for _ in range(c.n_routed_experts)
        )
        self._stacked: dict[str, torch.Tensor] = {}
        shapes = {"w1": (c.moe_intermediate_size, c.hidden_size), "w2": (c.hidden_size, c.moe_intermediate_size),
                  "w3": (c.moe_intermediate_size, c.hidden_size)}
        for name, shape in shapes.items():
            self._tie(name, torch.empty(c.n_routed_experts, *shape, dtype=dtype, device=device))
        self.shared_experts = Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, dtype=dtype, device=device)
        self.swiglu_limit = c.swiglu_limit
        self.fused = kernels.fused_moe == "triton"
        if self.fused:
            self._route = get_op(kernels, "moe_route")
            self._experts_op = get_op(kernels, "moe_experts")
            # W8A8 experts quantise x on a side stream while the router runs (`moe_w8a8.InputQuant`)
            self._quantize_input = getattr(self._experts_op, "quantize_input", None)
            # the Triton experts' one-launch counters are zeroed before the router (`moe.experts_counters`)
            self._experts_counters = None
            if kernels.moe_experts == "triton":  # Triton's module: get_op above required Triton
                from dspark.kernels.moe import experts_counters
                self._experts_counters = experts_counters
            self._top_k = c.num_experts_per_tok
            # gates with one bias row per token (V4.1's image spans): only where that op is picked
            self._route_rows = get_op(kernels, "moe_route_rows") if kernels.moe_route_rows != "ref" else None

    def _tie(self, name: str, stacked: torch.Tensor) -> None:
        """Make expert e's `name` weight the view stacked[e]."""
        self._stacked[name] = stacked
        for e, expert in enumerate(self.experts):
            getattr(expert, name).weight = nn.Parameter(stacked[e], requires_grad=False)

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1 [E, I, D], w2 [E, D, I], w3 [E, I, D]): the experts' weights as stacked tensors.

        They alias the per-expert parameters. If something replaced those parameters (e.g. a
        `module.to(...)`), they are stacked once more and the parameters re-pointed at the new stack.
        """
        first, last = self.experts[0], self.experts[-1]
        for name in _EXPERT_WEIGHTS:
            stacked = self._stacked[name]
            w0, w_last = getattr(first, name).weight, getattr(last, name).weight
            if w0.data_ptr() != stacked.data_ptr() or w_last.data_ptr() != stacked[-1].data_ptr() \
                    or w0.device != stacked.device or w0.dtype != stacked.dtype:
                with torch.no_grad():
                    self._tie(name, torch.stack([getattr(ex, name).weight.detach() for ex in self.experts]))
        return self._stacked["w1"], self._stacked["w2"], self._stacked["w3"]

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [N, D] (after ffn_norm), input_ids [N] -> [N, D]. Routed outputs accumulate in fp32."""
        if self.fused:
            return self._forward_fused(x, input_ids)
        return self.forward_ref(x, input_ids)

    def forward_ref(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """`forward` on the torch reference whatever `kernels` chose: differentiable (the fused ops
        have no backward), so a trained module (the DSpark stages) runs it under autograd."""
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

    def _forward_fused(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The registry's ops: the fused router where it computes the gate (`_routing`), then the experts.
        The routing's launches come after x was written and right before the experts', so the experts op
        may start the shared expert while they run (`x_ready`)."""
        shared = self.shared_experts
        parts = (*self.stacked_weights(), shared.w1.weight, shared.w2.weight, shared.w3.weight)
        # Work for the experts op that must precede the routing: W8A8 experts start x's quantisation (on its
        # side stream); the Triton experts' one launch takes counters zeroed before the router, so that no
        # memset sits between the router and it
        early = {} if self._quantize_input is None else {"x_fp8": self._quantize_input(x, *parts)}
        if self._experts_counters is not None:
            early["counters"] = self._experts_counters(x, *parts, self._top_k)
        weights, experts = self._routing(x, input_ids)
        return self._experts_op(x, weights, experts, *parts, swiglu_limit=self.swiglu_limit, x_ready=True, **early)

    def _routing(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, K] fp32, expert ids [N, K]): the fused router where it computes the gate
        (`Gate.fused_route_args`), else the gate module."""
        gate = self.gate
        ids = input_ids if self._route_rows is not None else None  # a per-token bias needs its op
        fused = gate.fused_route_args(ids) if isinstance(gate, Gate) else None
        if fused is None:
            return gate(x, input_ids)
        bias, tid2eid = fused.pop("gate_bias"), fused.pop("tid2eid")
        route = self._route_rows if bias is not None and bias.dim() == 2 else self._route
        return route(x, gate.weight, bias, tid2eid, input_ids, **fused)
