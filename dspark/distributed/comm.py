"""The collectives the parallel MoE layers and the lockstep engine need, over torch.distributed.

Every call is collective: all ranks of `Comm.group` must make the same calls in the same order.

Token dispatch uses `all_to_all_single` with uneven splits on both backends: NCCL implements it
natively, and gloo implements it for CPU tensors (checked: torch 2.11 / 2.13,
tests/distributed/test_dist_comm.py), so one code path serves CI and the GPUs. Split sizes must be
known on the host, hence one device→host copy of the counts per dispatch (DeepEP's low-latency mode
avoids it with fixed-size per-expert buffers; see docs/distributed.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Comm:
    """One process group as seen by this rank.

    group  : the ProcessGroup (None: the default group)
    rank, size : this rank and the group size
    device : where control tensors (counts, flags) live: CPU for gloo, this rank's GPU for NCCL
    """

    group: object
    rank: int
    size: int
    device: torch.device

    @classmethod
    def default(cls, device: torch.device | str) -> Comm:
        """The default (initialised) process group, control tensors on `device`."""
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: call dspark.distributed.init_distributed first")
        return cls(None, dist.get_rank(), dist.get_world_size(), torch.device(device))

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """counts int64 [size·m] (block j goes to rank j) -> int64 [size·m] (block j came from rank j)."""
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=self.group)
        return out

    def exchange_rows(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Send rows `x[sum(send[:j]) : sum(send[:j+1])]` to rank j; returns the received rows
        [sum(recv), *x.shape[1:]], those of rank 0 first. `send`/`recv` are host ints per rank."""
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=self.group)
        return out

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over ranks of `x`, in place, returned."""
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def any(self, flags: list[bool]) -> list[bool]:
        """Element-wise OR of a list of flags over all ranks (one small all-reduce)."""
        t = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in t.tolist()]
