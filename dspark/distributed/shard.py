"""`parallelize`: swap the MoE block of every target layer for its parallel version, from outside.

The model files stay single-device; this walks `model.layers[i].ffn` (DeepSeek-V4 and V4.1 alike)
and replaces each by the module of `ParallelConfig.layout`; under "tp" it also keeps each rank's
attention heads of `model.layers[i].attn` (`split_heads`). With `engram_shard` it first replaces
the hash table of every V4.1 Engram layer by this rank's rows (`ShardedEngramTable`). The MTP
block and the DSpark drafter's own blocks are left as they are: they run per DP rank, replicated,
and join no collective, so a rank may draft for its own requests whatever the other ranks do.
"""

from __future__ import annotations

from torch import nn

from dspark.distributed.attention import split_heads
from dspark.distributed.comm import Comm
from dspark.distributed.config import ParallelConfig
from dspark.distributed.engram_shard import shard_engram_tables
from dspark.distributed.fused_allreduce import PushWorkspace, fused_unsupported
from dspark.distributed.moe import ColumnMoE, DispatchMoE, SliceMoE

_MODULES = {"dep": DispatchMoE, "ep": SliceMoE, "tp": ColumnMoE}


def parallelize(model: nn.Module, config: ParallelConfig, comm: Comm) -> list[nn.Module]:
    """Replace each `model.layers[i].ffn` in place; returns the new modules in layer order.

    A single-process config leaves the model untouched (and returns []). Experts a rank does not
    own are dropped here: build the model, `parallelize`, then load (`load_sharded`) so that only
    owned experts are ever read. Raises ValueError when the process group does not match `config`
    or the experts (or, under "tp", the attention's output groups) do not split evenly, and for
    `engram_shard` on a model without Engram tables.
    """
    if config.layout == "single":
        return []
    if (comm.rank, comm.size) != (config.rank, config.world_size):
        raise ValueError(f"process group rank {comm.rank} of {comm.size} does not match "
                         f"ParallelConfig rank {config.rank} of {config.world_size}")
    if config.engram_shard:
        shard_engram_tables(model, comm, exchange=config.dp_attention)
    if config.layout == "tp":
        workspace = tp_workspace(model, config, comm)
        for layer in model.layers:
            split_heads(layer.attn, comm)
            layer.ffn = ColumnMoE(layer.ffn, comm, workspace)
        return [layer.ffn for layer in model.layers]
    for layer in model.layers:
        layer.ffn = _MODULES[config.layout](layer.ffn, comm)
    return [layer.ffn for layer in model.layers]


def tp_workspace(model: nn.Module, config: ParallelConfig, comm: Comm) -> PushWorkspace | None:
    """The symmetric buffers of the fused TP MoE epilogue, shared by every layer (they run one after
    the other), or None for the reference epilogue. Collective. `tp_epilogue` "auto" falls back to
    the reference where `fused_unsupported` says why; "fused" raises ValueError with that reason."""
    if config.tp_epilogue == "ref":
        return None
    reason = fused_unsupported(comm)
    if reason is not None:
        if config.tp_epilogue == "fused":
            raise ValueError(f"tp_epilogue='fused' cannot run here: {reason}")
        return None
    ffn = model.layers[0].ffn
    k, dim = ffn.gate.top_k, ffn.shared_experts.w1.in_features
    return PushWorkspace.create(comm, config.tp_fused_tokens * (k + 1), dim)
