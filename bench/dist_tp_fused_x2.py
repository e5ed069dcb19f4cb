"""TP2 MoE epilogue on two GPUs: fused (push all-reduce over symmetric memory + one Triton kernel)
against the unfused reference (NCCL all-reduce + torch finalize), alone and inside v4-mini decode.

    torchrun --nproc-per-node 2 bench/dist_tp_fused_x2.py     # nvidia-h200-x2; JSON to $OUT/dist_tp_fused_x2.json

NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set by default here (no NVLink
multicast anywhere). Needs CUDA, NCCL and Triton on both ranks.

Part 1, the epilogue alone at v4-mini shapes (D = 2048, K = 6, bf16 output) for N = 1, 8, 32, 64
tokens: bit-identical outputs fused vs reference (and across ranks), then the time per call
(CUDA events over ITERS calls after WARMUP; both include the same copy of the partials into the
buffer the path reads) and, to split it, the NCCL all-reduce of the [N, 7, 2048] fp32 partials
alone and the push + barrier alone.
Part 2, v4-mini bf16 under TP2 (random seeded weights, torch reference kernels elsewhere): prefill
logits of a ragged batch and 16 greedy tokens, fused vs reference epilogue (bit-identical
expected); then the decode step time at B = 1, 8, 32, 64 requests with each epilogue (CONTEXT
prompt tokens prefilled, WARMUP steps, STEPS timed). The same model serves both: the epilogue is
switched by giving the MoE layers the workspace or not.
"""

from __future__ import annotations

import json
import os
import subprocess
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
from dspark.distributed import ParallelConfig, init_distributed, parallelize, shutdown  # noqa: E402
from dspark.distributed.fused_allreduce import PushWorkspace, moe_epilogue, moe_epilogue_ref  # noqa: E402
from dspark.engine.engine import Engine, EngineConfig  # noqa: E402
from dspark.kernels import KernelConfig  # noqa: E402
from dspark.sampling import SamplingParams  # noqa: E402

DIM, TOP_K, N_EXPERTS = 2048, 6, 64  # v4-mini (dspark/configs/v4-mini.json)
TOKENS, WARMUP, ITERS = (1, 8, 32, 64), 20, 200
BATCHES, CONTEXT, STEP_WARMUP, STEPS = (1, 8, 32, 64), 64, 2, 10
PROMPTS = [list(range(3, 14)), [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] + [4] * 9, [7] * 13]


def _inputs(n: int, rank: int, device):
    g = torch.Generator().manual_seed(n)
    partials = torch.randn(2, n, TOP_K + 1, DIM, generator=g) * 3
    weights = torch.rand(n, TOP_K, generator=g) + 0.1
    ids = torch.stack([torch.randperm(N_EXPERTS, generator=g)[:TOP_K] for _ in range(n)])
    return partials[rank].to(device), weights.to(device), ids.to(device)


def _time_us(fn) -> float:
    for _ in range(WARMUP):
        fn()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / ITERS


def _epilogue_rows(comm, workspace, device) -> list[dict]:
    rows = []
    for n in TOKENS:
        src, weights, ids = _inputs(n, comm.rank, device)
        scratch = torch.empty_like(src)
        fused = moe_epilogue(workspace.partial(n, TOP_K).copy_(src), weights, ids, torch.bfloat16, workspace)
        ref = moe_epilogue_ref(scratch.copy_(src), weights, ids, torch.bfloat16, comm)
        mine = fused.view(torch.int16).int()  # bit patterns (NCCL has no int16)
        high, low = mine.clone(), mine.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        same_ranks = torch.equal(high, mine) and torch.equal(low, mine)  # max == min: equal on both ranks
        rows.append({
            "tokens": n, "bitwise_equal_to_reference": torch.equal(fused.view(torch.int16), ref.view(torch.int16)),
            "identical_on_both_ranks": same_ranks,
            "fused_us": _time_us(lambda: moe_epilogue(workspace.partial(n, TOP_K).copy_(src), weights, ids,
                                                      torch.bfloat16, workspace)),
            "reference_us": _time_us(lambda: moe_epilogue_ref(scratch.copy_(src), weights, ids, torch.bfloat16, comm)),
            "nccl_all_reduce_only_us": _time_us(lambda: dist.all_reduce(scratch)),
            "push_and_barrier_only_us": _time_us(lambda: workspace.push(workspace.partial(n, TOP_K))),
        })
    return rows


def _use(layers, workspace) -> None:
    for layer in layers:
        layer.workspace = workspace


def _model_check(model, layers, workspace, device) -> dict:
    out = {}
    for name, ws in (("reference", None), ("fused", workspace)):
        _use(layers, ws)
        states = [model.new_state() for _ in PROMPTS]
        logits = model(torch.tensor(sum(PROMPTS, []), device=device), states, [len(p) for p in PROMPTS]).logits
        engine = Engine(model, EngineConfig(max_running=4, draft_tokens=0))
        ids = [engine.add_request(p, SamplingParams(temperature=0.0), 16) for p in PROMPTS]
        tokens = {rid: [] for rid in ids}
        while engine.has_work():
            for event in engine.step():
                tokens[event.request_id] += event.new_token_ids
        out[name] = (logits, [tokens[rid] for rid in ids])
    (ref_logits, ref_tokens), (fused_logits, fused_tokens) = out["reference"], out["fused"]
    return {"prefill_tokens": sum(map(len, PROMPTS)),
            "logits_bitwise_equal": torch.equal(ref_logits.view(torch.int16), fused_logits.view(torch.int16)),
            "max_abs_logit_diff": float((ref_logits.float() - fused_logits.float()).abs().max()),
            "greedy_tokens_identical": ref_tokens == fused_tokens}


def _step_ms(model, batch: int, device) -> float:
    g = torch.Generator(device=device).manual_seed(batch)
    states = [model.new_state() for _ in range(batch)]
    model(torch.randint(0, 256, (batch * CONTEXT,), generator=g, device=device), states, [CONTEXT] * batch)
    nxt = torch.randint(0, 256, (batch,), generator=g, device=device)
    for step in range(STEP_WARMUP + STEPS):
        if step == STEP_WARMUP:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        nxt = model(nxt, states, [1] * batch).logits.argmax(-1)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / STEPS


def main() -> int:
    started = time.perf_counter()
    config = ParallelConfig(world_size=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]),
                            local_rank=int(os.environ["LOCAL_RANK"]), tp=2, backend="nccl", tp_epilogue="fused",
                            tp_fused_tokens=max(max(TOKENS), max(BATCHES)))
    comm = init_distributed(config)
    device = torch.device("cuda", config.local_rank)
    try:
        # Buffers and model are made outside inference mode (they are written in place later).
        workspace = PushWorkspace.create(comm, max(TOKENS) * (TOP_K + 1), DIM)
        model = init_model("v4-mini", seed=0, device=device, dtype=torch.bfloat16, kernels=KernelConfig.uniform("ref"))
        layers = parallelize(model, config, comm)  # tp_epilogue="fused": raises with the reason if it cannot run
        model_workspace = layers[0].workspace
        with torch.inference_mode():
            epilogue = _epilogue_rows(comm, workspace, device)
            print(f"rank {config.rank} epilogue {epilogue}", flush=True)
            check = _model_check(model, layers, model_workspace, device)
            decode = []
            for batch in BATCHES:
                for name, ws in (("reference", None), ("fused", model_workspace)):
                    _use(layers, ws)
                    ms = _step_ms(model, batch, device)
                    decode.append({"batch": batch, "epilogue": name, "step_ms": ms, "tokens_per_s": 1e3 * batch / ms})
            print(f"rank {config.rank} decode {decode}", flush=True)
        gathered = [None] * config.world_size if config.rank == 0 else None
        dist.gather_object({"epilogue": epilogue, "model_check": check, "decode": decode}, gathered, dst=0)
    finally:
        shutdown()
    if config.rank == 0:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
        result = {
            "bench": "dist_tp_fused_x2", "commit": commit or None, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0), "ranks_n": config.world_size,
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
            "shapes": {"hidden": DIM, "top_k": TOP_K, "experts": N_EXPERTS, "out_dtype": "bfloat16"},
            "epilogue_timing": {"warmup": WARMUP, "iters": ITERS, "method": "CUDA events, mean per call"},
            "model": "v4-mini bf16, random seeded weights, torch reference kernels outside the epilogue",
            "context_tokens": CONTEXT, "decode_warmup_steps": STEP_WARMUP, "decode_steps": STEPS,
            "ranks": gathered, "wall_s": time.perf_counter() - started,
        }
        out = Path(os.environ.get("OUT", REPO / "bench/results"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "dist_tp_fused_x2.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
