"""Sharded Engram tables (`engram_shard`) over NCCL on 2 GPUs: correctness and lookup latency.

    torchrun --nproc-per-node 2 bench/engram_shard_nccl.py     # nvidia-h200-x2; JSON to $OUT/engram_shard_nccl.json

(On a machine without GPUs it runs the same over gloo with a small table, as a smoke test.)
Keep NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (set by default here).

Part 1, correctness: tiny-v41 (fp32, random weights, exact prefill) with its Engram tables on the
GPU and in pinned host memory: for the "ep", "tp" and "dep" layouts, prefill logits with sharded
tables against the same layout with replicated tables (expected bit-identical) and against one
process (max |Δ|), and greedy tokens of the engine (lockstep under "dep", where rank 1 has fewer
requests and idles) against one process; and the same prefill against one process with the KV
cache's QAT rounding off (`cache_qat=False`), where only fp32 summation order may differ.
Part 2, latency: one bf16 table of ROWS × 256 (host, pinned: the released placement; and on the
GPU), random columns of N tokens × 24 hash columns: the replicated lookup, the sharded lookup
with the same columns on both ranks (all-reduce) and with each rank's own columns (exchange), each
checked bit-identical to the replicated one; median of REPS CUDA-synchronised calls after warm-up.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dspark.api import init_model  # noqa: E402
from dspark.distributed import (LockstepEngine, ParallelConfig, ShardedEngramTable, init_distributed,  # noqa: E402
                                parallelize, shutdown)
from dspark.engine.engine import Engine, EngineConfig  # noqa: E402
from dspark.models.deepseek_v41.engram import EngramTable  # noqa: E402
from dspark.sampling import SamplingParams  # noqa: E402

GPU = torch.cuda.is_available()
ROWS = 1 << 24 if GPU else 1 << 14  # 16.8 M rows × 256 bf16 = 8 GiB whole, 4 GiB per rank
TOKENS = (64, 256, 4096) if GPU else (64,)
COLUMNS, WIDTH, WARMUP, REPS = 24, 256, 3, 20
PROMPTS = [list(range(3, 14)), [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] + [4] * 9]
MAX_NEW = [6, 9, 4]
MINE = {0: [0, 1], 1: [2]}
LAYOUTS = {"ep": dict(ep=2), "tp": dict(tp=2), "dep": dict(ep=2, dp_attention=True)}


def _generate(engine, which):
    ids = {i: engine.add_request(PROMPTS[i], SamplingParams(temperature=0.0), MAX_NEW[i]) for i in which}
    out = {rid: [] for rid in ids.values()}
    more = engine.has_work_anywhere if isinstance(engine, LockstepEngine) else engine.has_work
    while more():
        for event in engine.step():
            out[event.request_id] += event.new_token_ids
    return {i: out[rid] for i, rid in ids.items()}


def _logits(model, prompts, device):
    states = [model.new_state() for _ in prompts]
    return model(torch.tensor(sum(prompts, []), device=device), states, [len(p) for p in prompts]).logits


def _correctness(rank, comm, device, backend) -> dict:
    engine_config = EngineConfig(max_running=4)
    results = {}
    for placement in ("device", "host"):
        def make(cache_qat=True):
            return init_model("tiny-v41", seed=0, device=device, prefill_mode="exact", engram_tables=placement,
                              cache_qat=cache_qat)

        ref_logits = _logits(make(), PROMPTS, device)
        ref_tokens = _generate(Engine(make(), engine_config), range(3))
        for layout, kwargs in LAYOUTS.items():
            mine = MINE[rank] if layout == "dep" else list(range(3))
            rows = torch.cat([torch.arange(sum(map(len, PROMPTS[:i])), sum(map(len, PROMPTS[:i + 1]))) for i in mine])
            logits, tokens = {}, None
            for shard in (False, True):
                config = ParallelConfig(2, rank, backend=backend, engram_shard=shard, **kwargs)
                model = make()
                layers = parallelize(model, config, comm)
                logits[shard] = _logits(model, [PROMPTS[i] for i in mine], device)
                if shard:
                    engine = (LockstepEngine(model, engine_config, comm, layers) if layout == "dep"
                              else Engine(model, engine_config))
                    tokens = _generate(engine, mine)
            # The KV cache's QAT rounding (on by default) turns the ~1e-6 differences of another summation
            # order into whole FP8 steps; without it the layouts must agree with one process to fp32 rounding.
            plain = make(cache_qat=False)
            parallelize(plain, ParallelConfig(2, rank, backend=backend, engram_shard=True, **kwargs), comm)
            plain_ref = _logits(make(cache_qat=False), PROMPTS, device)[rows.to(device)]
            results[f"{placement}/{layout}"] = {
                "bit_identical_to_replicated": bool(torch.equal(logits[True], logits[False])),
                "max_abs_diff_vs_one_process": float((logits[True] - ref_logits[rows.to(device)]).abs().max()),
                "tokens_equal_one_process": tokens == {i: ref_tokens[i] for i in mine},
                "max_abs_diff_vs_one_process_no_cache_qat": float(
                    (_logits(plain, [PROMPTS[i] for i in mine], device) - plain_ref).abs().max()),
            }
    return results


def _time(fn, device) -> float:
    """Median milliseconds of `fn()` over REPS calls after WARMUP."""
    times = []
    for i in range(WARMUP + REPS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= WARMUP:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _table(placement, device) -> EngramTable:
    """The same random bf16 table on every rank (drawn on `device` in chunks, seeded)."""
    table = EngramTable(ROWS, WIDTH, dtype=torch.bfloat16, device=device, host=placement == "host")
    g = torch.Generator(device=device).manual_seed(7)
    chunk = 1 << 20
    with torch.no_grad():
        for start in range(0, ROWS, chunk):
            stop = min(start + chunk, ROWS)
            values = torch.randn(stop - start, WIDTH, generator=g, device=device, dtype=torch.bfloat16)
            table.weight[start:stop].copy_(values)
    return table


def _latency(rank, comm, device) -> dict:
    results = {}
    for placement in ("host", "device"):
        table = _table(placement, device)
        summed = ShardedEngramTable.from_table(table, comm, exchange=False)
        exchanged = ShardedEngramTable(summed.weight.data, ROWS, comm, exchange=True, host=summed.host)  # same rows
        g = torch.Generator(device=device).manual_seed(11)
        for n in TOKENS:
            same = torch.randint(0, ROWS, (n, COLUMNS), generator=g, device=device)
            own = torch.randint(0, ROWS, (n, COLUMNS), generator=g.manual_seed(100 + rank), device=device)
            g.manual_seed(11 + n)
            results[f"{placement}/tokens={n}"] = {
                "bit_identical_allreduce": bool(torch.equal(summed.lookup(same, device), table.lookup(same, device))),
                "bit_identical_exchange": bool(torch.equal(exchanged.lookup(own, device), table.lookup(own, device))),
                "replicated_ms": _time(lambda: table.lookup(own, device), device),
                "sharded_allreduce_ms": _time(lambda: summed.lookup(same, device), device),
                "sharded_exchange_ms": _time(lambda: exchanged.lookup(own, device), device),
            }
        del table, summed, exchanged
    return results


def main() -> None:
    backend = "nccl" if GPU else "gloo"
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    comm = init_distributed(ParallelConfig(2, rank, local_rank=local, ep=2, backend=backend))
    device = comm.device
    try:
        mine = {"correctness": _correctness(rank, comm, device, backend), "latency": _latency(rank, comm, device)}
        gathered = [None, None] if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank == 0:
            out = {"device": torch.cuda.get_device_name(device) if GPU else "cpu", "backend": backend,
                   "torch": torch.__version__, "rows": ROWS, "width": WIDTH, "columns": COLUMNS,
                   "ranks": gathered}
            target = Path(os.environ.get("OUT", ".")) / "engram_shard_nccl.json"
            target.write_text(json.dumps(out, indent=2) + "\n")
            print(json.dumps(out, indent=2))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
