"""`ShardedEngramTable`: a DeepSeek-V4.1 Engram hash table split by rows over the ranks.

The tables (V4.1-Flash: 2 × 384 M rows × 256, ~98 GB each in bf16) are the largest tensors of the
model, and their rows are independent (FP8 with 1 × 32 scales along the row on disk, dequantised
at load like the replicated `EngramTable`). Rank r of N keeps rows [r·V/N, (r+1)·V/N)
(`owned_rows`), in the placement the model chose for the whole table (host memory or the device),
and answers lookups with the same `lookup(columns, device)` as `EngramTable`:

* same tokens on every rank ("ep", "tp"): each rank fills the rows it owns and zeros elsewhere,
  and one all-reduce (sum) of the [N, C, hd] result completes it. Every element is the sum of one
  rank's row value and zeros, which is exact, so the result equals the replicated lookup bit for
  bit (up to the sign of a zero);
* own tokens per rank ("dep"): the distinct row ids are sent to their owners (all-to-all of the
  counts, one host sync for the split sizes, then of the ids), each rank gathers the rows asked of
  it, and they travel back the same way (copies only: exact). A rank without tokens joins with an
  empty request (`idle`), which `LockstepEngine.idle_forward` does for every table.

The lookups of all Engram layers run before layer 0 (spec §8.5), in `engram_ids` order on every
rank, so every rank makes the same collective calls in the same order.

Shape symbols: N tokens, C hash columns per token, hd row width, V table rows, M distinct rows.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.distributed.comm import Comm


def owned_rows(total: int, rank: int, size: int) -> range:
    """Rows [rank·total/size, (rank+1)·total/size) of a `total`-row table (any total >= size)."""
    return range(rank * total // size, (rank + 1) * total // size)


class ShardedEngramTable(nn.Module):
    """This rank's rows of one layer's hash table, `weight` [len(rows), hd] (checkpoint key
    `engram.embed.weight`, read as this row range by `load_sharded`).

    total_rows : V, rows of the whole table; rows : the owned range (`owned_rows`)
    exchange : False — every rank looks up the same columns (all-reduce of zero-filled rows);
        True — each rank its own (DP attention: ids and rows exchanged all-to-all)
    host : the weight lives in host memory (pinned when CUDA is available), as `EngramTable`'s
    """

    def __init__(self, weight: torch.Tensor, total_rows: int, comm: Comm, exchange: bool, host: bool):
        super().__init__()
        self.rows = owned_rows(total_rows, comm.rank, comm.size)
        if weight.shape[0] != len(self.rows):
            raise ValueError(f"weight: {weight.shape[0]} rows, but rank {comm.rank} of {comm.size} owns "
                             f"{len(self.rows)} of {total_rows}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.total_rows = total_rows
        self.comm = comm
        self.exchange = exchange
        self.host = host
        # First row of every rank, then V [size + 1]: buckets sorted row ids by owner. A plain
        # attribute, not a buffer: it lives with the collectives (`comm.device`), not the weight.
        self.bounds = torch.tensor([owned_rows(total_rows, r, comm.size).start for r in range(comm.size)]
                                   + [total_rows], device=comm.device)

    @classmethod
    def from_table(cls, table: nn.Module, comm: Comm, exchange: bool) -> ShardedEngramTable:
        """This rank's part of `table` (an `EngramTable`): its rows copied out of a loaded table; a
        table still on the meta device (`deferred_weights`) gives uninitialised rows for the
        loader — on the meta device too, unless the table lives in host memory."""
        total, dim = table.weight.shape
        if total < comm.size:
            raise ValueError(f"engram_shard: a table of {total} rows cannot be split over {comm.size} ranks")
        rows = owned_rows(total, comm.rank, comm.size)
        shape, dtype = (len(rows), dim), table.weight.dtype
        if table.host:
            weight = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())
        else:
            weight = torch.empty(shape, dtype=dtype, device=table.weight.device)
        if not table.weight.is_meta:
            weight.copy_(table.weight.detach()[rows.start:rows.stop])
        return cls(weight, total, comm, exchange, table.host)

    def lookup(self, columns: torch.Tensor, device: torch.device) -> torch.Tensor:
        """columns [N, C] long (table rows, on any device) -> rows [N, C, hd] on `device`, in the
        weight's dtype. Collective: every rank calls it for the same table."""
        if self.exchange:
            return self._exchanged(columns, device)
        return self._summed(columns, device)

    def idle(self) -> None:
        """Join one DP-attention lookup with no tokens (a rank without work this forward call)."""
        self.lookup(torch.empty(0, 1, dtype=torch.long, device=self.comm.device), self.comm.device)

    def _summed(self, columns: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Same columns on every rank: own rows, zeros elsewhere, summed over the ranks."""
        flat = columns.flatten().to(self.weight.device)
        owned = (flat >= self.rows.start) & (flat < self.rows.stop)  # [N·C]
        local = torch.where(owned, flat - self.rows.start, 0)
        rows = self._gather(local, ~owned)  # [N·C, hd]
        out = rows.to(device, non_blocking=True)  # host to device or a no-op
        return self.comm.all_reduce_sum(out).view(*columns.shape, self.weight.shape[1])

    def _exchanged(self, columns: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Own columns per rank: distinct ids to their owners, rows back."""
        ids, inverse = torch.unique(columns.flatten().to(self.comm.device), sorted=True, return_inverse=True)  # [M]
        # Sorted ids fall into contiguous owner blocks: the counts are differences of insertion points.
        counts = torch.searchsorted(ids, self.bounds).diff()  # [size]
        received = self.comm.exchange_counts(counts)
        send, recv = torch.stack((counts, received)).tolist()  # the one host sync of this lookup
        asked = self.comm.exchange_rows(ids, send, recv)  # [Σ recv] ids in this rank's range, rank 0's first
        local = (asked - self.rows.start).to(self.weight.device)
        answer = self._gather(local, None).to(self.comm.device, non_blocking=True)  # [Σ recv, hd]
        rows = self.comm.exchange_rows(answer, recv, send)  # [M, hd], in the order of `ids`
        return rows[inverse].view(*columns.shape, self.weight.shape[1]).to(device)

    def _gather(self, local: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        """Rows `local` [M] of the weight -> [M, hd] on the weight's device (into pinned memory when
        the weight is pinned, so the copy to the device can be asynchronous); rows where `zero` [M]
        is True are zeroed."""
        if self.weight.is_pinned():
            rows = torch.empty((local.numel(), self.weight.shape[1]), dtype=self.weight.dtype, pin_memory=True)
            torch.index_select(self.weight, 0, local, out=rows)
        else:
            rows = self.weight.index_select(0, local)
        if zero is not None:
            rows.masked_fill_(zero.unsqueeze(-1), 0)
        return rows


def shard_engram_tables(model: nn.Module, comm: Comm, exchange: bool) -> list[ShardedEngramTable]:
    """Replace the hash table of every Engram layer of `model` (`model.layers[i].engram.embed` for i in
    `model.engram_ids`) by this rank's `ShardedEngramTable`; returns them in lookup order. Raises
    ValueError for a model without Engram layers (only DeepSeek-V4.1 has them)."""
    ids = tuple(getattr(model, "engram_ids", ()))
    if not ids:
        raise ValueError(f"engram_shard=True, but {type(model).__name__} has no Engram tables "
                         "(only DeepSeek-V4.1 with engram_layer_ids has them)")
    tables = []
    for i in ids:
        engram = model.layers[i].engram
        engram.embed = ShardedEngramTable.from_table(engram.embed, comm, exchange)
        tables.append(engram.embed)
    return tables


def sharded_tables(model: nn.Module) -> list[ShardedEngramTable]:
    """The model's sharded tables in lookup order (`engram_ids`), [] when they are replicated."""
    tables = [model.layers[i].engram.embed for i in getattr(model, "engram_ids", ())]
    return [t for t in tables if isinstance(t, ShardedEngramTable)]
