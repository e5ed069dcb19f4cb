"""Head-parallel attention for the "tp" layout (DeepSeek-V4 and V4.1 share `LatentAttention`).

Rank r of t keeps the output groups [r·G/t, (r+1)·G/t) and the query heads they read,
[r·H/t, (r+1)·H/t) (group g reads heads g·H/G .. (g+1)·H/G − 1, so the two slices line up):

    wq_b      rows of its heads            [H/t·d, q_lora]
    attn_sink its heads                    [H/t]        fp32
    wo_a      rows of its groups           [G/t·R, H·d/G]
    wo_b      columns of its groups        [D, G/t·R]   -> `ReduceLinear`: fp32 partial, one all-reduce

Everything else is replicated and computed on every rank: wq_a / q_norm (c_q also feeds the
indexer), the single shared KV latent (num_key_value_heads = 1: every head reads it), the
compressors and the indexer. Per head, the query norm, RoPE and the sink softmax do not mix heads,
and `wo_a` is block-diagonal over groups, so every value up to `wo_b`'s input is bit-identical to
one process. Only `wo_b` sums over groups: its partial products are accumulated in fp32, summed in
fp32 over ranks and rounded to the model dtype once, which is where the unfused GEMM rounds too
(bf16 × bf16 products are exact in fp32). The fp32 sum order differs (each rank's G/t·R columns,
then over ranks), so results agree with one process to fp32 rounding of that sum.

Shape symbols: N rows, H heads, d head_dim, G o_groups, R o_lora_rank, D hidden, t ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.distributed.comm import Comm


class ReduceLinear(nn.Module):
    """A linear layer split along its input features: `weight` [out, in/t] is this rank's column
    block. Output = Σ over ranks of x_r · W_rᵀ, accumulated in fp32 and rounded once to x.dtype."""

    def __init__(self, linear: nn.Linear, cols: slice, comm: Comm):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("ReduceLinear: a bias would be added once per rank")
        # A copy, so the full weight's storage is freed with the replaced module.
        self.weight = nn.Parameter(linear.weight[:, cols].clone(memory_format=torch.contiguous_format),
                                   requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in/t] (this rank's slice of the input) -> [N, out] in x.dtype, identical on all ranks."""
        partial = F.linear(x.float(), self.weight.float())  # [N, out] fp32
        return self.comm.all_reduce_sum(partial).to(x.dtype)


def split_heads(attn: nn.Module, comm: Comm) -> nn.Module:
    """Keep this rank's heads and output groups of one `LatentAttention` (in place); returns it.

    Raises ValueError when the output groups do not split evenly over the ranks.
    """
    heads, groups, t = attn.n_heads, attn.o_groups, comm.size
    if groups % t:
        raise ValueError(f"o_groups={groups} is not divisible by tp={t}: attention heads split by output group")
    g0, g1 = comm.rank * groups // t, (comm.rank + 1) * groups // t
    h0, h1 = g0 * heads // groups, g1 * heads // groups
    d, r = attn.head_dim, attn.o_lora_rank
    attn.wq_b = _row_block(attn.wq_b, slice(h0 * d, h1 * d))
    attn.attn_sink = nn.Parameter(attn.attn_sink[h0:h1].clone(), requires_grad=False)
    attn.wo_a = _row_block(attn.wo_a, slice(g0 * r, g1 * r))
    attn.wo_b = ReduceLinear(attn.wo_b, slice(g0 * r, g1 * r), comm)
    # The forward reads these to shape q [N, H/t, d] and the grouped wo_a [G/t, R, H·d/G].
    attn.n_heads, attn.o_groups = h1 - h0, g1 - g0
    return attn


def _row_block(linear: nn.Linear, rows: slice) -> nn.Linear:
    """A new bias-free linear holding a copy of `linear.weight[rows]` (a copy, not a view, so the full
    weight's storage is freed with the replaced module)."""
    weight = linear.weight[rows]
    part = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    part.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return part
