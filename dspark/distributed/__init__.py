"""Beyond one device: expert parallelism, DP attention and tensor parallelism over torch.distributed.

    config = ParallelConfig(world_size=2, rank=r, ep=2, dp_attention=True, backend="nccl",
                            engram_shard=True)       # optional: V4.1 Engram tables split by rows
    comm = init_distributed(config)                          # joins the default process group
    model, moe = load_sharded(path, config, comm, device=device_for(config))   # owned experts only
    engine = LockstepEngine(model, EngineConfig(...), comm, moe)              # this rank's requests
    while engine.has_work_anywhere(): engine.step()

The launcher (`dspark.distributed.launch`, used by the CLI under torchrun) is the only place that
reads the environment. See docs/distributed.md.
"""

from dspark.distributed.attention import ReduceLinear, split_heads
from dspark.distributed.comm import Comm
from dspark.distributed.config import ParallelConfig
from dspark.distributed.deferred import deferred_weights, materialize
from dspark.distributed.engine import LockstepEngine
from dspark.distributed.engram_shard import ShardedEngramTable
from dspark.distributed.fused_allreduce import PushWorkspace, moe_epilogue, moe_epilogue_ref
from dspark.distributed.loading import build_sharded, load_sharded
from dspark.distributed.moe import ColumnMoE, DispatchMoE, SliceMoE, expert_slice
from dspark.distributed.setup import device_for, init_distributed, shutdown
from dspark.distributed.shard import parallelize

__all__ = ["ColumnMoE", "Comm", "DispatchMoE", "LockstepEngine", "ParallelConfig", "PushWorkspace", "ReduceLinear",
           "ShardedEngramTable", "SliceMoE", "build_sharded", "deferred_weights", "device_for", "expert_slice", "init_distributed",
           "load_sharded", "materialize", "moe_epilogue", "moe_epilogue_ref", "parallelize", "shutdown", "split_heads"]
