"""The TP MoE epilogue: cross-rank sum of the expert partials, MoE finalize and shared-expert add.

Under `ColumnMoE` every rank holds, for each of its N tokens, the fp32 w2 partials of the token's K
routed slots and of the shared expert: `partial` [N, K+1, D]. The epilogue turns them into the
block output, identical on every rank. Rounding points (the unfused path, and the single-device
block it reproduces):

    out_j = bf16( Σ_r partial_r[n, j] )           fp32 sum over ranks, one rounding per expert output
    y     = bf16( Σ_k g_k · out_k + out_K )       fp32, routed slots in ascending expert id, then shared

(bf16 stands for the model dtype; with fp32 models the roundings are no-ops.)

* `moe_epilogue_ref` — torch: `dist.all_reduce` of the fp32 partials, then the finalize as torch
  ops. Runs on any backend (gloo in CI). This is the unfused path.
* `moe_epilogue` — one-shot push all-reduce over symmetric memory fused with the finalize: each
  rank stores its partials into slot [rank] of every peer's buffer (unicast copies over
  NVLink, no multicast), one signal-pad barrier, then one Triton kernel (`epilogue_kernel.py`,
  imported on first use) sums the t slots in rank order, rounds each expert output, weights,
  adds the shared expert and rounds once. Every rank
  reads the same t slots in the same order, so all ranks get bit-identical outputs. With t = 2 it
  also equals the reference bit for bit (a + b = b + a in IEEE arithmetic, whatever order NCCL
  adds in); with t > 2 both are deterministic but sum the t partials in different orders.

Both take `(partial, weights, ids, out_dtype, group)`: `group` is a `Comm` for the reference and a
`PushWorkspace` (the same group with its symmetric buffers) for the fused op.

Shape symbols: N tokens, K experts per token, D hidden, t ranks, M rows the workspace holds (N·(K+1)).
"""

from __future__ import annotations

import importlib
import socket

import torch
import torch.distributed as dist

from dspark.distributed.comm import Comm
from dspark.kernels import require_triton, triton_available

BLOCK_D = 512


def moe_epilogue_ref(partial: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, out_dtype: torch.dtype,
                     group: Comm) -> torch.Tensor:
    """partial [N, K+1, D] fp32 (routed slots, then shared; summed over ranks in place),
    weights [N, K] fp32, ids [N, K] -> [N, D] in `out_dtype`, identical on every rank."""
    out = group.all_reduce_sum(partial).to(out_dtype)  # [N, K+1, D]: whole expert outputs, rounded
    k = ids.shape[1]
    order = torch.argsort(ids, dim=1, stable=True)  # [N, K] slots by expert id (the single-device order)
    routed = torch.zeros(out.shape[0], out.shape[2], dtype=torch.float32, device=out.device)  # [N, D]
    for j in range(k):
        slot = order[:, j:j + 1]  # [N, 1]
        term = out.gather(1, slot.unsqueeze(-1).expand(-1, -1, out.shape[2])).squeeze(1)  # [N, D]
        routed += term.float() * weights.gather(1, slot)
    return (routed + out[:, k].float()).to(out_dtype)


class PushWorkspace:
    """Symmetric buffers of one group for the fused epilogue: `buffer` [2, t, M, D] fp32 on every rank.

    buffer[p, r] receives rank r's partials; p alternates per call (double buffering) so that a
    rank may push call i+1 while a slower peer still reads call i: the barrier of call i+1 cannot
    complete before every peer finished call i, so call i+2 never overwrites unread rows.
    Collective to build (`create`); every rank must then make the same `moe_epilogue` calls.
    Not capturable in a CUDA graph (the parity flips on the host).
    """

    def __init__(self, comm: Comm, buffer: torch.Tensor, handle, peers: list[torch.Tensor]):
        self.comm, self.buffer, self.handle, self.peers = comm, buffer, handle, peers
        self.max_rows, self.dim = buffer.shape[2], buffer.shape[3]
        self._parity = 0

    @classmethod
    def create(cls, comm: Comm, max_rows: int, dim: int) -> PushWorkspace:
        """Allocate and rendezvous the buffers over `comm` (collective; CUDA + NCCL, see `fused_unsupported`)."""
        from torch.distributed import _symmetric_memory as symm_mem

        buffer = symm_mem.empty((2, comm.size, max_rows, dim), dtype=torch.float32, device=comm.device)
        group = comm.group if comm.group is not None else dist.group.WORLD
        handle = symm_mem.rendezvous(buffer, group.group_name)
        # Each peer's buffer mapped into this process (the local one is `buffer` itself).
        peers = [buffer if r == comm.rank else handle.get_buffer(r, tuple(buffer.shape), torch.float32)
                 for r in range(comm.size)]
        return cls(comm, buffer, handle, peers)

    def fits(self, rows: int) -> bool:
        return rows <= self.max_rows

    def partial(self, n: int, k: int) -> torch.Tensor:
        """This rank's slot of the current buffer as [n, k+1, D] fp32 (uninitialised): compute into it."""
        return self.buffer[self._parity, self.comm.rank, :n * (k + 1)].view(n, k + 1, self.dim)

    def push(self, partial: torch.Tensor) -> torch.Tensor:
        """Send `partial` [N, K+1, D] to slot [rank] of every peer, wait for every peer's rows;
        returns the current buffer's rows [t, N·(K+1), D] (rank stride M·D) and flips the parity."""
        rows = partial.shape[0] * partial.shape[1]
        parity, rank = self._parity, self.comm.rank
        mine = self.buffer[parity, rank, :rows]
        if mine.data_ptr() != partial.data_ptr():
            mine.copy_(partial.reshape(rows, self.dim))
        for r, peer in enumerate(self.peers):
            if r != rank:
                peer[parity, rank, :rows].copy_(mine)  # unicast stores into the peer's memory
        self.handle.barrier(channel=0)  # release our stores to every peer, acquire theirs
        self._parity ^= 1
        return self.buffer[parity, :, :rows]


def moe_epilogue(partial: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, out_dtype: torch.dtype,
                 group: PushWorkspace) -> torch.Tensor:
    """`moe_epilogue_ref` as one push all-reduce and one kernel. partial [N, K+1, D] fp32 (ideally
    `group.partial(N, K)`, which saves a copy), weights [N, K] fp32, ids [N, K] -> [N, D] `out_dtype`."""
    require_triton()
    n, k = ids.shape
    if not group.fits(n * (k + 1)):
        raise ValueError(f"{n} tokens × {k + 1} slots exceed the workspace's {group.max_rows} rows")
    return finalize_slots(group.push(partial), weights, ids, out_dtype)


def finalize_slots(slots: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The kernel half of `moe_epilogue`: slots [t, N·(K+1), D] fp32 (rank r's partials in slots[r];
    any stride between ranks), weights [N, K] fp32, ids [N, K] -> [N, D] `out_dtype`."""
    require_triton()
    n, k = ids.shape
    dim = slots.shape[2]
    if slots.shape[1] != n * (k + 1) or slots.dtype != torch.float32 or slots[0].stride() != (dim, 1):
        raise ValueError(f"slots must be fp32 [t, {n * (k + 1)}, {dim}] with contiguous rows, "
                         f"got {slots.dtype} {tuple(slots.shape)} strides {slots.stride()}")
    out = torch.empty(n, dim, dtype=out_dtype, device=slots.device)
    if n == 0:
        return out
    # Loaded on first use, so that importing dspark.distributed never imports Triton.
    from dspark.distributed.epilogue_kernel import epilogue_kernel

    grid = (n, -(-dim // BLOCK_D))
    # No FMA contraction: the reference multiplies and adds with two roundings.
    epilogue_kernel[grid](slots, ids.contiguous(), weights.float().contiguous(), out, dim, slots.stride(0),
                          K=k, K_PAD=1 << (k - 1).bit_length(), RANKS=slots.shape[0], BLOCK_D=BLOCK_D,
                          num_warps=4, enable_fp_fusion=False)
    return out


def fused_unsupported(comm: Comm) -> str | None:
    """Why the fused epilogue cannot run on this group (None: it can). Collective: every rank gets
    the same answer, so all ranks take the same path (a mixed choice would deadlock)."""
    reason = _local_reason(comm)
    hosts = [None] * comm.size
    dist.all_gather_object(hosts, (socket.gethostname(), reason), group=comm.group)
    reasons = [f"rank {r}: {why}" for r, (_, why) in enumerate(hosts) if why is not None]
    if not reasons and len({host for host, _ in hosts}) > 1:
        reasons.append("the ranks span several hosts (symmetric memory maps peers' GPU memory on one host)")
    return "; ".join(reasons) or None


def _local_reason(comm: Comm) -> str | None:
    if comm.device.type != "cuda":
        return f"device {comm.device} is not a CUDA device"
    if dist.get_backend(comm.group) != "nccl":
        return f"backend {dist.get_backend(comm.group)!r} is not nccl"
    if not triton_available():
        return "triton is not installed (pip install -e '.[gpu]')"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as error:
        return f"torch.distributed._symmetric_memory is unavailable ({error})"
    return None
