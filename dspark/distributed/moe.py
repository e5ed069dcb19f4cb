"""Parallel replacements for the MoE block of DeepSeek-V4 / V4.1 (`dspark.models.deepseek_v4.moe.MoE`).

Each module keeps the call signature `(x [N, D], input_ids [N]) -> [N, D]` and the checkpoint names
of the module it replaces, so a layer cannot tell the difference:

* `DispatchMoE` (DEP): this rank's tokens go to the ranks that own their experts and come back
  weighted. `experts` is a ModuleDict keyed by the *global* expert id, so its state-dict names are
  the checkpoint keys of the owned experts (`layers.3.ffn.experts.17.w1.weight`) and a sharded
  load reads exactly those.
* `SliceMoE` (EP over replicated requests): owned experts over all tokens, shared expert on rank 0,
  one all-reduce.
* `ColumnMoE` (TP over replicated requests): every expert split along its width I, then the
  epilogue of `fused_allreduce` (cross-rank sum of the per-slot partials, finalize, shared add;
  fused on CUDA) with the single-device bf16 rounding points.

The router is replicated (and the shared expert, except under `ColumnMoE`). Routed outputs are
combined in fp32 like the single-process block; in `DispatchMoE` / `SliceMoE` the summation order
differs (slot order instead of expert order, and over ranks), so results agree with it to fp32
rounding, not bit for bit; `ColumnMoE` differs only inside each expert's last GEMM.

Shape symbols: N tokens of this rank, K experts per token, D hidden, E routed experts, m = E / ranks
experts per rank, R rows received by this rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.distributed.comm import Comm
from dspark.distributed.fused_allreduce import PushWorkspace, moe_epilogue, moe_epilogue_ref
from dspark.models.deepseek_v4.moe import Expert


def expert_slice(n_experts: int, rank: int, size: int) -> range:
    """Global ids of the experts rank `rank` of `size` owns: a contiguous block of E / size."""
    if n_experts % size:
        raise ValueError(f"n_routed_experts={n_experts} is not divisible by ep={size}")
    per_rank = n_experts // size
    return range(rank * per_rank, (rank + 1) * per_rank)


def _split(values: list[int], size: int) -> list[list[int]]:
    """Host list of size·m ints -> size lists of m."""
    m = len(values) // size
    return [values[j * m:(j + 1) * m] for j in range(size)]


class DispatchMoE(nn.Module):
    """Expert-parallel MoE for DP attention (all-to-all dispatch and combine).

    Per call: route locally; sort the N·K assignments by expert (so by owner rank); exchange the
    per-expert counts [E] (one host sync); send each assignment's token row to the owner; the owner
    runs its experts over the rows it received, grouped by expert (rows of rank 0 first, token order
    inside), and sends the outputs back along the same path; finalize y = Σ_k g_k · out_k + Shared(x).
    A rank with no tokens still calls it (with N = 0: `idle`) so every rank joins every exchange.
    """

    def __init__(self, moe: nn.Module, comm: Comm):
        super().__init__()
        self.gate, self.shared_experts = moe.gate, moe.shared_experts
        self.n_experts = len(moe.experts)
        self.owned = expert_slice(self.n_experts, comm.rank, comm.size)
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in self.owned})
        self.comm = comm

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [N, D] (after ffn_norm), input_ids [N] -> [N, D] in x.dtype."""
        weights, ids = self.gate(x, input_ids)  # [N, K] fp32, [N, K]
        n, k = ids.shape
        flat = ids.reshape(-1).long()  # [N·K], token-major
        order = torch.argsort(flat, stable=True)  # assignments by expert, token order inside
        counts = torch.bincount(flat, minlength=self.n_experts)  # [E]
        recv_counts = self.comm.exchange_counts(counts)  # [E] = [size, m]: row j from rank j
        sent, got = (_split(c, self.comm.size) for c in torch.stack([counts, recv_counts]).tolist())
        send_rank, recv_rank = [sum(c) for c in sent], [sum(c) for c in got]
        rows = self.comm.exchange_rows(x[order // k], send_rank, recv_rank)  # [R, D]
        out = self._run_experts(rows, recv_counts, [sum(col) for col in zip(*got)])  # [R, D] x.dtype
        back = self.comm.exchange_rows(out, recv_rank, send_rank)  # [N·K, D], in `order`
        per_slot = torch.empty_like(back).index_copy_(0, order, back).view(n, k, x.shape[1])  # [N, K, D]
        routed = (per_slot.float() * weights.unsqueeze(-1)).sum(dim=1)  # [N, D] fp32
        return (routed + self.shared_experts(x).float()).to(x.dtype)

    def _run_experts(self, rows: torch.Tensor, recv_counts: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """rows [R, D] grouped by source rank, then by local expert -> expert outputs [R, D]."""
        m = len(self.owned)
        local = torch.arange(m, device=rows.device).repeat(self.comm.size)  # [size·m]
        expert_of = torch.repeat_interleave(local, recv_counts.to(rows.device), output_size=rows.shape[0])  # [R]
        perm = torch.argsort(expert_of, stable=True)  # by expert; rank, then token order inside
        grouped = rows[perm]
        outs, start = [], 0
        for e, count in zip(self.owned, per_expert):
            if count:
                outs.append(self.experts[str(e)](grouped[start:start + count]))
                start += count
        done = torch.cat(outs) if outs else rows.new_empty(rows.shape)
        return torch.empty_like(rows).index_copy_(0, perm, done)

    def idle(self, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Join one call's exchanges with no tokens (this rank has no request in this phase)."""
        self(torch.zeros(0, dim, dtype=dtype, device=device), torch.zeros(0, dtype=torch.long, device=device))


class SliceMoE(nn.Module):
    """Expert-parallel MoE over replicated tokens: Σ over owned experts (+ the shared expert on rank 0),
    then one fp32 all-reduce. `experts` is keyed by global expert id, as in `DispatchMoE`."""

    def __init__(self, moe: nn.Module, comm: Comm):
        super().__init__()
        self.gate, self.shared_experts = moe.gate, moe.shared_experts
        self.owned = expert_slice(len(moe.experts), comm.rank, comm.size)
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in self.owned})
        self.comm = comm

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [N, D] (identical on every rank), input_ids [N] -> [N, D] in x.dtype."""
        weights, ids = self.gate(x, input_ids)
        partial = _routed_sum(x, weights, ids, {e: self.experts[str(e)] for e in self.owned})
        if self.comm.rank == 0:
            partial += self.shared_experts(x).float()
        return self.comm.all_reduce_sum(partial).to(x.dtype)


class ColumnMoE(nn.Module):
    """Tensor-parallel MoE over replicated tokens: rank r holds columns [r·I/t, (r+1)·I/t) of w1 and w3
    and the same rows of w2 for every routed expert and the shared expert. The clamped SwiGLU is
    element-wise in I, so the partial outputs sum to the full expert output.

    The rounding points of the single-device block are kept: each rank's w2 partials stay fp32, the
    K + 1 partial outputs of every token (its routed slots and the shared expert) are summed over
    ranks in fp32, each summed expert output is rounded to x.dtype (where one device rounds the
    expert's GEMM), and the finalize Σ_k g_k · out_k + shared runs in fp32 in the single-device
    order (ascending expert id). Only the fp32 sum order inside w2 differs (I/t columns, then over
    ranks). The epilogue (`fused_allreduce`) sends K + 1 rows per token instead of one: the price of
    exact rounding, small at the decode batch sizes this layout is for. With a `workspace` it runs
    fused (one-shot push all-reduce + one kernel) whenever the call's N·(K+1) rows fit it, else
    as NCCL/gloo all-reduce + torch ops; every rank sees the same N, so all take the same path.
    """

    def __init__(self, moe: nn.Module, comm: Comm, workspace: PushWorkspace | None = None):
        super().__init__()
        self.gate = moe.gate
        self.comm = comm
        self.workspace = workspace
        self.shared_experts = _column_slice(moe.shared_experts, comm.rank, comm.size)
        self.experts = nn.ModuleList(_column_slice(e, comm.rank, comm.size) for e in moe.experts)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [N, D] (identical on every rank), input_ids [N] -> [N, D] in x.dtype."""
        weights, ids = self.gate(x, input_ids)  # [N, K] fp32, [N, K]
        n, k = ids.shape
        fused = self.workspace is not None and self.workspace.fits(n * (k + 1))
        if fused:  # computed straight into this rank's symmetric slot; every row is written below
            partial = self.workspace.partial(n, k)  # [N, K+1, D]
        else:
            partial = torch.zeros((n, k + 1, x.shape[1]), dtype=torch.float32, device=x.device)
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()  # one host sync
        for e, count in enumerate(counts):
            if count:
                token, slot = torch.where(ids == e)
                partial[token, slot] = _partial_output(self.experts[e], x[token])
        partial[:, k] = _partial_output(self.shared_experts, x)
        if fused:
            return moe_epilogue(partial, weights, ids, x.dtype, self.workspace)
        return moe_epilogue_ref(partial, weights, ids, x.dtype, self.comm)


def _partial_output(expert: Expert, x: torch.Tensor) -> torch.Tensor:
    """`Expert.forward` of a width slice with the last GEMM left in fp32: x [n, D] -> [n, D] fp32.

    Up to w2's input every value equals the full expert's (the SwiGLU is element-wise in I)."""
    gate, up = expert.w1(x).float(), expert.w3(x).float()
    if expert.limit > 0:
        gate = gate.clamp(max=expert.limit)
        up = up.clamp(min=-expert.limit, max=expert.limit)
    hidden = (F.silu(gate) * up).to(x.dtype)
    return F.linear(hidden.float(), expert.w2.weight.float())  # bf16 products are exact in fp32


def _column_slice(expert: Expert, rank: int, size: int) -> Expert:
    """The rank's width slice of one expert (a new module holding copies of the slices)."""
    inter = expert.w1.out_features
    if inter % size:
        raise ValueError(f"moe_intermediate_size={inter} is not divisible by tp={size}")
    cols = slice(rank * inter // size, (rank + 1) * inter // size)
    w = expert.w1.weight
    part = Expert(expert.w1.in_features, inter // size, expert.limit, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        part.w1.weight.copy_(expert.w1.weight[cols])
        part.w3.weight.copy_(expert.w3.weight[cols])
        part.w2.weight.copy_(expert.w2.weight[:, cols])
    return part.requires_grad_(False)


def _routed_sum(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: dict[int, nn.Module]) -> torch.Tensor:
    """Σ_k g_k · Expert_{ids_k}(x) over the experts in `experts` only, fp32 [N, D] (one host sync)."""
    routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    counts = torch.bincount(ids.flatten(), minlength=max(experts, default=0) + 1).tolist()
    for e, expert in experts.items():
        if counts[e]:
            token, slot = torch.where(ids == e)
            routed.index_add_(0, token, expert(x[token]).float() * weights[token, slot].unsqueeze(-1))
    return routed
