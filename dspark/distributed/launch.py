"""`dspark generate --ep/--tp/--dp-attention/--engram-shard` under torchrun: the launcher edge.

This is the only module of `dspark.distributed` that reads the environment (torchrun's RANK,
WORLD_SIZE, LOCAL_RANK; MASTER_ADDR / MASTER_PORT are read by torch's env:// rendezvous). It turns
them and the CLI flags into a `ParallelConfig`, joins the group, loads the model shard by shard and
decodes. Under DP attention prompt i goes to rank i mod world_size; rank 0 prints every result in
prompt order.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import torch.distributed as dist

from dspark.api import RANDOM_TINY, load_model
from dspark.distributed.config import ParallelConfig
from dspark.distributed.engine import LockstepEngine
from dspark.distributed.loading import load_sharded
from dspark.distributed.setup import device_for, init_distributed, shutdown
from dspark.distributed.shard import parallelize
from dspark.engine.engine import Engine, EngineConfig
from dspark.sampling import SamplingParams
from dspark.tokenizer import as_text_codec
from dspark.validate import encode_prompts


def config_from_env(ep: int, tp: int, dp_attention: bool, backend: str,
                    environ: Mapping[str, str] = os.environ, tp_epilogue: str = "auto",
                    engram_shard: bool = False) -> ParallelConfig:
    """ParallelConfig from torchrun's variables (absent: a single process) and the CLI flags."""
    def number(name: str, default: int) -> int:
        value = environ.get(name, str(default))
        if not value.isdigit():
            raise ValueError(f"{name}={value!r} is not a non-negative integer")
        return int(value)

    return ParallelConfig(world_size=number("WORLD_SIZE", 1), rank=number("RANK", 0),
                          local_rank=number("LOCAL_RANK", 0), ep=ep, tp=tp, dp_attention=dp_attention,
                          backend=backend, tp_epilogue=tp_epilogue, engram_shard=engram_shard)


def _model(name: str, config: ParallelConfig, comm):
    """(model, parallel MoE layers); `random-tiny` (no checkpoint) is built whole, then parallelised."""
    if name == RANDOM_TINY:
        model = load_model(name, device=device_for(config))
        return model, parallelize(model, config, comm)
    return load_sharded(name, config, comm, device=device_for(config))


def generate_distributed(args) -> int:
    """Body of `dspark generate` when --ep/--tp > 1 (args from dspark.cli)."""
    config = config_from_env(args.ep, args.tp, args.dp_attention, args.backend, tp_epilogue=args.tp_epilogue,
                             engram_shard=args.engram_shard)
    comm = init_distributed(config)
    try:
        model, moe_layers = _model(args.model, config, comm)
        prompts, _ = encode_prompts(model, list(args.prompt))
        mine = [i for i in range(len(prompts)) if i % config.dp_size == config.dp_rank]
        engine_config = EngineConfig(max_running=max(1, len(mine)), max_new_tokens=args.max_new_tokens,
                                     draft_tokens=args.draft_tokens or 0, drafter=args.drafter)  # None: plain
        engine = (LockstepEngine(model, engine_config, comm, moe_layers) if config.layout == "dep"
                  else Engine(model, engine_config))
        # Replicated layouts must sample identically on every rank: a fixed default seed.
        seed = args.seed if args.seed is not None else 0
        ids = {engine.add_request(prompts[i], SamplingParams(args.temperature, args.top_p, args.top_k, seed + i),
                                  args.max_new_tokens): i for i in mine}
        tokens = {i: [] for i in mine}
        more = engine.has_work_anywhere if config.layout == "dep" else engine.has_work
        while more():
            for event in engine.step():
                tokens[ids[event.request_id]] += event.new_token_ids
        gathered = [None] * config.world_size if config.rank == 0 else None
        dist.gather_object(tokens, gathered, dst=0)
        if config.rank == 0:
            _print(model, args.prompt, {i: t for part in gathered for i, t in part.items()})
    finally:
        shutdown()
    return 0


def _print(model, prompts: list[str], tokens: dict[int, list[int]]) -> None:
    codec = as_text_codec(getattr(model, "tokenizer", None))
    for i, prompt in enumerate(prompts):
        print(prompt + codec.decode(tokens[i]) if codec else tokens[i])
    print(f"[{sum(map(len, tokens.values()))} tokens over {len(prompts)} prompts]", file=sys.stderr)
