"""The attention sink applied after a kernel that ignores it (flashinfer's MLA kernels).

V4's sink is a per-head logit that joins each softmax denominator only (spec §7.4). A kernel that
softmaxes over the keys alone returns out and its log-sum-exp lse; the sink then scales each
(row, head) of out by

    e^lse / (e^lse + e^sink) = sigmoid(lse − sink),  and 0 for a row without keys (all mass on the sink).

Two places apply that factor:

* ``apply_sink(out, lse, sink, lengths) -> out``: one pass over out, in place (`apply_sink_ref` is
  its torch reference, same signature).
* inside the next op's operand load: `grouped_wo_a` takes a `SinkGate` and scales each head's
  channels as it loads them (`sink_rows`), so no pass over out runs at all.

Shapes: out [S, H, d], lse [S, H] fp32 natural log, sink [H], lengths [S] (key counts).
Rounding: the factor is computed in fp32 and out · factor is rounded once to out's dtype, in both
places, so the fold gives `grouped_wo_a` the operand the separate pass would have written.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dspark.kernels.registry import require_triton
from dspark.kernels.triton_compat import jit as _jit, tl, triton


class SinkGate(NamedTuple):
    """What the sink needs after a kernel without it: lse [S, H] fp32 (natural log, over the keys
    only), sink [H] logits, lengths [S] key counts (a row with 0 keys gets factor 0)."""

    lse: torch.Tensor
    sink: torch.Tensor
    lengths: torch.Tensor

    def check(self, n_rows: int, n_heads: int) -> None:
        """A ValueError naming the shape that does not fit out [n_rows, n_heads, d]."""
        if tuple(self.lse.shape) != (n_rows, n_heads) or tuple(self.sink.shape) != (n_heads,) \
                or tuple(self.lengths.shape) != (n_rows,):
            raise ValueError(f"sink gate must be lse [{n_rows}, {n_heads}], sink [{n_heads}], lengths [{n_rows}], "
                             f"got {tuple(self.lse.shape)}, {tuple(self.sink.shape)}, {tuple(self.lengths.shape)}")


def sink_factor(gate: SinkGate) -> torch.Tensor:
    """[S, H] fp32: sigmoid(lse − sink), 0 on rows without keys."""
    factor = torch.sigmoid(gate.lse.float() - gate.sink.float())
    return factor.masked_fill((gate.lengths == 0).unsqueeze(-1), 0.0)


def scale_by_sink(out: torch.Tensor, gate: SinkGate) -> torch.Tensor:
    """out [S, H, d] · `sink_factor` -> a new tensor in out's dtype (rounded once)."""
    return (out.float() * sink_factor(gate).unsqueeze(-1)).to(out.dtype)


def apply_sink_ref(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """out [S, H, d] (softmax over the keys only), lse [S, H], sink [H], lengths [S] -> out with the
    sink (in place, returned)."""
    return out.copy_(scale_by_sink(out, SinkGate(lse, sink, lengths)))


@_jit
def sink_rows(lse_ptr, sink_ptr, len_ptr, rows, row_mask, head, n_heads):
    """The factor of `head` (a scalar) for `rows` [BLOCK] (int64): [BLOCK] fp32, 0 where masked."""
    lse = tl.load(lse_ptr + rows * n_heads + head, mask=row_mask, other=0.0)
    sink = tl.load(sink_ptr + head).to(tl.float32)
    keys = tl.load(len_ptr + rows, mask=row_mask, other=0)
    return tl.where(keys > 0, 1.0 / (1.0 + tl.exp(sink - lse)), 0.0)


@_jit
def _sink_kernel(out_ptr, lse_ptr, sink_ptr, len_ptr, n_heads, head_dim,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[s, heads of block, :] *= sigmoid(lse − sink), 0 where row s has no keys."""
    s = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < n_heads
    lse = tl.load(lse_ptr + s * n_heads + offs_h, mask=h_mask, other=0.0)
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    weight = 1.0 / (1.0 + tl.exp(sink - lse))
    weight = tl.where(tl.load(len_ptr + s) > 0, weight, 0.0)
    rows = (s * n_heads + offs_h)[:, None] * head_dim
    for d0 in range(0, head_dim, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = h_mask[:, None] & (offs_d[None, :] < head_dim)
        out = tl.load(out_ptr + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows + offs_d[None, :], (out * weight[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`apply_sink_ref` as one Triton pass (same signature; out contiguous, modified in place)."""
    require_triton()
    n_q, n_heads, head_dim = out.shape
    if n_q:
        block_h = min(16, triton.next_power_of_2(n_heads))
        _sink_kernel[(n_q, triton.cdiv(n_heads, block_h))](
            out, lse.contiguous(), sink.contiguous(), lengths.contiguous(), n_heads, head_dim,
            BLOCK_H=block_h, BLOCK_D=min(128, triton.next_power_of_2(head_dim)), num_warps=4)
    return out


def sparse_attention_lse_ref(q: torch.Tensor, pool: torch.Tensor, index: torch.Tensor,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What a sink-less kernel returns: (out [S, H, d] in q's dtype, softmax over the listed keys
    alone; lse [S, H] fp32 of the scaled scores). Rows without keys: out 0, lse −inf.
    `sparse_attention_ref` with sink s equals `apply_sink_ref(out, lse, s, lengths)` up to rounding."""
    keys = pool[index.clamp(min=0)].float()  # [S, K, d]
    scores = torch.einsum("shd,skd->shk", q.float(), keys) * scale
    scores = scores.masked_fill((index < 0).unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [S, H]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.einsum("shk,skd->shd", probs, keys).to(q.dtype), lse
