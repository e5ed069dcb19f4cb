"""`moe_experts` on DeepGEMM's grouped FP8 GEMM (contiguous layout): an optional, W8A8 backend.

Same signature and meaning as `moe.moe_experts` (y = Σ_k weights_k · Expert_{ids_k}(x) + Shared(x),
clamped SwiGLU experts, spec §11.2); numerics as `deep_gemm_path` says: activations are quantised to
e4m3 per token per 128 columns before both expert GEMMs, and each GEMM's output is rounded to bf16,
so the result differs from the weights-only `"ref"` / `"triton"` paths by fp8 quantisation error.
Opt-in only (``KernelConfig(fused_moe="triton", moe_experts="deep_gemm")``).

Pipeline (torch ops around two deep_gemm calls, no host sync):

1. pack the N·K assignments by expert, each group padded to the library's M alignment (128 on
   Hopper), in R = N·K + min(N·K, E)·(align − 1) rows (`moe._pack_by_expert`, the Triton path's
   static bound);
2. quantise x per token once, gather the packed rows (padding rows: zeros);
3. ``m_grouped_fp8_gemm_nt_contiguous`` with W13 = [W1; W3] stacked along N: [R, 2I] bf16, then the
   clamped SwiGLU in fp32 and its per-token quantisation;
4. the same grouped GEMM with W2: [R, D] bf16;
5. the shared expert: two dense ``fp8_gemm_nt`` calls (`deep_gemm_path.fp8_linear`);
6. y = shared + Σ_k weights_k · row(token, k), in fp32, cast to x.dtype.

Contiguous layout (`grouped_layout` [R] int32): row r of the packed A belongs to expert
grouped_layout[r]; every alignment block holds one expert. Padding rows and unused blocks are -1,
which the current release skips (their output rows are left undefined and never read); the older
release reads every block's first id unchecked, so there padding rows carry their block's expert and
unused blocks expert 0, computed on zero rows and discarded.

Shape symbols: N tokens, D hidden, E routed experts, K = top_k, I expert width (I_s shared),
R packed rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.kernels.autograd import records_grad
from dspark.kernels.deep_gemm_path import (
    BLOCK, DeepGemmApi, DeepGemmOp, DeepGemmWeight, weight_key, fp8_linear, gemm_shape_reason,
    dequantize_rows, mn_major_tma_aligned, quantize_rows,
)
from dspark.kernels.fp8 import FP8BlockWeight
from dspark.kernels.moe import _check_expert_args, _check_routing_args, _pack_by_expert


def _stack_n(a, b) -> torch.Tensor | FP8BlockWeight:
    """[W_a; W_b] along N (dim -2): tensors, or FP8 weights with their scale rows (I % 128 == 0)."""
    if isinstance(a, FP8BlockWeight):
        return FP8BlockWeight(torch.cat((a.data, b.data), -2), torch.cat((a.scale, b.scale), -2), a.block)
    return torch.cat((a.detach(), b.detach()), -2)


@dataclass(frozen=True)
class DeepGemmExperts:
    """Routed and shared expert weights in deep_gemm's RHS layout, converted once per weight set.

    w13 [E, 2I, D] (gate rows, then up rows), w2 [E, D, I]; shared_w13 [2I_s, D], shared_w2 [D, I_s].
    """

    w13: DeepGemmWeight
    w2: DeepGemmWeight
    shared_w13: DeepGemmWeight
    shared_w2: DeepGemmWeight

    @classmethod
    def from_weights(cls, w1, w2, w3, shared_w1, shared_w2, shared_w3) -> DeepGemmExperts:
        """From `moe_experts`' weight arguments (tensors or FP8BlockWeight with 128×128 blocks)."""
        return cls(DeepGemmWeight.from_weight(_stack_n(w1, w3)), DeepGemmWeight.from_weight(w2),
                   DeepGemmWeight.from_weight(_stack_n(shared_w1, shared_w3)), DeepGemmWeight.from_weight(shared_w2))


def experts_shape_reason(dim: int, inter: int, inter_shared: int, block: int | None) -> str | None:
    """Why deep_gemm cannot run these experts, or None: 128×128 FP8 blocks (or dense weights), and
    D, I, I_s multiples of 128 (each is a K of one GEMM; W13's halves must split on a block row)."""
    if block not in (None, BLOCK):
        return f"deep_gemm takes 128x128 weight blocks, got FP8 block {block}"
    for name, size in (("D", dim), ("I", inter), ("I_s", inter_shared)):
        if size % BLOCK:
            return f"deep_gemm MoE needs {name} % {BLOCK} == 0, got {name}={size}"
    return gemm_shape_reason(2 * inter, dim)


def _swiglu(h13: torch.Tensor, limit: float) -> torch.Tensor:
    """[M, 2I] (gate, up) -> silu(min(gate, L)) · clamp(up, −L, L) [M, I] fp32."""
    gate, up = h13.float().chunk(2, dim=-1)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def grouped_layout(rows: torch.Tensor, block_expert: torch.Tensor, n_assign: int, n_exp: int,
                   align: int, legacy: bool) -> torch.Tensor:
    """The contiguous layout [R] int32 of packed `rows` (module docstring): expert per row, -1 on
    padding rows and unused blocks (older release: the block's expert, and 0 for unused blocks)."""
    row_expert = block_expert.repeat_interleave(align)  # [R], E on unused blocks
    if legacy:
        return torch.where(row_expert < n_exp, row_expert, 0).to(torch.int32)
    return torch.where(rows < n_assign, row_expert, -1).to(torch.int32)


def _grouped(api: DeepGemmApi, a: torch.Tensor, sf: torch.Tensor, weight: DeepGemmWeight,
             layout: torch.Tensor) -> torch.Tensor:
    """One grouped GEMM: a [R, K] e4m3 with row-major sf [R, Kb] -> [R, N] bf16."""
    out = torch.empty((a.shape[0], weight.data.shape[1]), dtype=torch.bfloat16, device=a.device)
    api.grouped_contiguous((a, mn_major_tma_aligned(sf)), (weight.data, weight.scale), out, layout)
    return out


def moe_experts_deep_gemm(api: DeepGemmApi, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                          experts: DeepGemmExperts, swiglu_limit: float) -> torch.Tensor:
    """The pipeline of the module docstring: x [N, D], weights [N, K] fp32, ids [N, K] int (checked
    by the caller; shapes accepted by `experts_shape_reason`) -> y [N, D] in x.dtype."""
    n_tok, dim = x.shape
    n_exp, top_k = experts.w13.data.shape[0], ids.shape[1]
    n_assign = n_tok * top_k
    align = int(api.alignment())
    rows, block_expert, slot = _pack_by_expert(ids, n_exp, align)
    layout = grouped_layout(rows, block_expert, n_assign, n_exp, align, api.legacy)
    xq, xs = quantize_rows(x)
    # Row N of the extended x is the zero row the padding rows (sentinel N·K -> N·K // K = N) read.
    xq = torch.cat((xq, xq.new_zeros(1, dim)))
    xs = torch.cat((xs, xs.new_ones(1, xs.shape[1])))
    src = rows.long() // top_k  # [R]
    h = _swiglu(_grouped(api, xq[src], xs[src], experts.w13, layout), swiglu_limit)  # [R, I] fp32
    h = torch.where((rows < n_assign)[:, None], h, 0.0)  # skipped rows hold undefined values: no NaN past here
    routed = _grouped(api, *quantize_rows(h), experts.w2, layout)  # [R, D] bf16
    shared = fp8_linear(api, x, experts.shared_w13)
    shared = fp8_linear(api, _swiglu(shared, swiglu_limit), experts.shared_w2).float()  # [N, D]
    picked = routed[slot].float().view(n_tok, top_k, dim)  # [N, K, D]
    return (shared + (weights.float()[..., None] * picked).sum(1)).to(x.dtype)


def moe_experts_w8a8_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: DeepGemmExperts,
                         swiglu_limit: float) -> torch.Tensor:
    """Torch reference of `moe_experts_deep_gemm` (same arguments but the API): per expert, x
    quantised per token per 128 columns (`deep_gemm_path.quantize_rows`), fp32 GEMMs with the dequantised
    weights, each GEMM output rounded to bf16, SwiGLU in fp32 and quantised again; fp32 sum."""

    def act(t):  # the W8A8 activation: quantised and dequantised, per token per 128 columns
        return dequantize_rows(*quantize_rows(t))

    def gemm(t, w):
        return (act(t) @ w.T).to(torch.bfloat16).float()

    w13, w2 = experts.w13.dequantize(), experts.w2.dequantize()
    y = gemm(_swiglu(gemm(x, experts.shared_w13.dequantize()), swiglu_limit), experts.shared_w2.dequantize())
    for e in range(w13.shape[0]):
        tok, k = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel():
            out = gemm(_swiglu(gemm(x[tok], w13[e]), swiglu_limit), w2[e])
            y.index_add_(0, tok, weights[tok, k, None].float() * out)
    return y.to(x.dtype)


class DeepGemmMoeExperts(DeepGemmOp):
    """`moe_experts(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, *, swiglu_limit)` on
    deep_gemm (module docstring); weights converted on first use and cached on this instance."""

    op_name = "moe_experts"
    fallback_module = "moe"

    def __call__(self, x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3, *, swiglu_limit: float,
                 x_ready: bool = False):
        if x.dim() != 2:
            raise ValueError(f"x must be [N, D], got shape {tuple(x.shape)}")
        _check_routing_args(x, weights, ids, w1.shape[0])
        _check_expert_args(x, w1.shape[0], w1, w2, w3, shared_w1, shared_w2, shared_w3)
        args = (x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3)
        api = self._api(x.device)
        reason = api if isinstance(api, str) else self._call_reason(*args)
        if reason is not None:
            return self._fall_back(reason, x.device)(*args, swiglu_limit=swiglu_limit, x_ready=x_ready)
        self.fallback_reason = None  # x_ready (moe.moe_experts' launch-order promise): deep_gemm does not use it
        parts = (w1, w2, w3, shared_w1, shared_w2, shared_w3)
        key = sum((weight_key(w) for w in parts), ())
        experts = self._converted(key, lambda: DeepGemmExperts.from_weights(*parts))
        return moe_experts_deep_gemm(api, x, weights, ids, experts, swiglu_limit)

    @staticmethod
    def _call_reason(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3) -> str | None:
        tensors = [t.data if isinstance(t, FP8BlockWeight) else t for t in (w1, w2, w3, shared_w1, shared_w2,
                                                                             shared_w3)]
        if records_grad(x, *tensors):
            return "autograd is recording (deep_gemm has no backward)"
        bad = sorted(w.block for w in (w1, w2, w3, shared_w1, shared_w2, shared_w3)
                     if isinstance(w, FP8BlockWeight) and w.block != BLOCK)
        return experts_shape_reason(x.shape[1], w1.shape[1], shared_w1.shape[0], bad[0] if bad else None)
