"""`ParallelConfig`: how one process takes part in a multi-process run, validated once at the edge.

Three layouts, each over all `world_size` ranks of the default process group:

* ``dep``  (``ep = world_size``, ``dp_attention=True``) — DP attention + expert parallelism: each
  rank owns its own requests and runs attention, mHC and the head for them (replicated weights);
  routed experts are split into `ep` contiguous slices and tokens travel to the rank owning their
  experts (all-to-all dispatch / combine). The seeds' DEP4 prefill and DEP64 decode are this layout.
* ``ep``   (``ep = world_size``, ``dp_attention=False``) — every rank runs the same requests; each
  computes its expert slice for all tokens and one all-reduce sums the partial MoE outputs.
* ``tp``   (``tp = world_size``) — every rank runs the same requests; attention is split by output
  group (its query heads, `wo_a` rows and `wo_b` columns; the shared KV latent is replicated) and
  every expert (and the shared expert) along its width I; one all-reduce after each. For small
  decode batches, where all-to-all latency dominates.

Attention weights are replicated in the other layouts. `world_size = 1` with `ep = tp = 1` is the
single-process run.

Under "tp" the MoE epilogue (cross-rank sum, finalize, shared-expert add) runs either as NCCL's
all-reduce plus torch ops or fused (`dspark.distributed.fused_allreduce`): `tp_epilogue` "auto"
fuses where the group supports it (CUDA, NCCL, one host, Triton) and batches fit
`tp_fused_tokens`, "fused" requires it, "ref" never fuses.

`engram_shard` splits DeepSeek-V4.1's Engram hash tables by rows over the ranks instead of
replicating them (`dspark.distributed.engram_shard`), in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("gloo", "nccl")
EPILOGUES = ("auto", "fused", "ref")


@dataclass(frozen=True)
class ParallelConfig:
    """world_size, rank : this process in the default group (torchrun's WORLD_SIZE / RANK).
    local_rank : device index on this host (torchrun's LOCAL_RANK), for `cuda:{local_rank}`.
    ep, tp : expert- / tensor-parallel degree (at most one above 1, and then equal to world_size).
    dp_attention : each rank serves its own requests (needs ep = world_size > 1).
    backend : "gloo" (CPU tensors) or "nccl" (CUDA tensors).
    tp_epilogue : "auto", "fused" or "ref": the TP MoE epilogue (see the module docstring).
    tp_fused_tokens : the most tokens per MoE call the fused epilogue takes (it sizes the symmetric
        buffers: 2·t·tokens·(K+1)·D fp32 per rank); larger calls use the reference.
    engram_shard : each rank holds 1/world_size of the rows of every Engram table (V4.1 only; the
        lookups then cross the ranks); False replicates the tables."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    ep: int = 1
    tp: int = 1
    dp_attention: bool = False
    backend: str = "gloo"
    tp_epilogue: str = "auto"
    tp_fused_tokens: int = 128
    engram_shard: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "ep", "tp", "tp_fused_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("rank", "local_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} outside [0, world_size={self.world_size})")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.tp_epilogue not in EPILOGUES:
            raise ValueError(f"tp_epilogue must be one of {EPILOGUES}, got {self.tp_epilogue!r}")
        if self.tp_epilogue == "fused" and (self.tp == 1 or self.backend != "nccl"):
            raise ValueError(f"tp_epilogue='fused' needs tp > 1 on nccl, got tp={self.tp}, backend={self.backend!r}")
        for name in ("dp_attention", "engram_shard"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.ep > 1 and self.tp > 1:
            raise ValueError(f"ep={self.ep} and tp={self.tp}: combining expert and tensor parallelism is not supported")
        degree = max(self.ep, self.tp)
        if degree != self.world_size:
            raise ValueError(f"ep={self.ep}, tp={self.tp}: the parallel degree must equal world_size={self.world_size}")
        if self.dp_attention and self.ep == 1:
            raise ValueError(f"dp_attention needs ep = world_size > 1, got ep={self.ep}")
        if self.engram_shard and self.world_size == 1:
            raise ValueError("engram_shard=True needs several ranks to shard over, got world_size=1")

    @property
    def layout(self) -> str:
        """"single", "dep", "ep" or "tp" (see the module docstring)."""
        if self.world_size == 1:
            return "single"
        if self.tp > 1:
            return "tp"
        return "dep" if self.dp_attention else "ep"

    @property
    def dp_size(self) -> int:
        """Independent request streams: world_size under DP attention, else 1."""
        return self.world_size if self.dp_attention else 1

    @property
    def dp_rank(self) -> int:
        return self.rank if self.dp_attention else 0
