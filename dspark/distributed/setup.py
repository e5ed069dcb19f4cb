"""Process-group setup and teardown for a `ParallelConfig` (the launcher reads the environment)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dspark.distributed.comm import Comm
from dspark.distributed.config import ParallelConfig


def device_for(config: ParallelConfig) -> torch.device:
    """This rank's device: `cuda:{local_rank}` with NCCL, the CPU with gloo."""
    return torch.device("cuda", config.local_rank) if config.backend == "nccl" else torch.device("cpu")


def init_distributed(config: ParallelConfig, init_method: str = "env://") -> Comm:
    """Join the default process group described by `config`; returns its `Comm`.

    `init_method` "env://" is torchrun's rendezvous (MASTER_ADDR / MASTER_PORT, read by torch);
    tests pass "tcp://127.0.0.1:PORT" or "file://...". With NCCL the rank's GPU becomes the
    current device first, so NCCL binds its communicator to it.
    """
    device = device_for(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(config.backend, init_method=init_method, rank=config.rank,
                            world_size=config.world_size, device_id=device if device.type == "cuda" else None)
    return Comm.default(device)


def shutdown() -> None:
    """Leave the process group (no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()
