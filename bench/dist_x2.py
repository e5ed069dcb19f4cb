"""DEP2 (DP attention + expert parallelism over NCCL) on 2 GPUs: GPU correctness and v4-mini decode throughput.

    torchrun --nproc-per-node 2 bench/dist_x2.py            # on nvidia-h200-x2; JSON to $OUT/dist_x2.json

Keep NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (set by default here): nothing uses
NVLink multicast. Part 1, correctness: tiny V4 (fp32, random weights) — each rank computes the
single-process reference itself, then its share under DEP2: prefill logits (max |Δ|) and greedy
tokens of the lockstep engine (MTP drafter, 1 draft token) against the single-process engine.
Part 2, throughput: v4-mini (dspark/configs/v4-mini.json = shared/bench/v4-mini.json), random bf16
weights, B = 64 and 256 requests per GPU, plain greedy decode: (a) one GPU alone — each rank runs
the unsplit model on its own B requests, no communication; (b) DEP2 — the same, with the routed
experts split over the two GPUs and all-to-all dispatch/combine. Context: each request is prefilled
for real with CONTEXT random tokens (no fabricated state), then STEPS decode steps are timed (after
WARMUP) with CUDA synchronisation; tokens/s per GPU = B · steps / time. Both runs use the torch
reference MoE (a host loop over experts; DEP2: over the 32 owned experts), not the fused kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dspark.api import build_model, init_model  # noqa: E402
from dspark.distributed import LockstepEngine, ParallelConfig, init_distributed, parallelize, shutdown  # noqa: E402
from dspark.engine.engine import Engine, EngineConfig  # noqa: E402
from dspark.sampling import SamplingParams  # noqa: E402

CONTEXT, WARMUP, STEPS, BATCHES = 64, 2, 8, (64, 256)
TIME_BUDGET_S = float(os.environ.get("DIST_BUDGET_S", 330))  # stop adding measurements past this


def _random_fill(model, seed: int) -> None:
    """Random weights drawn on the GPU, seeded per tensor name (so an expert has the same values in
    the unsplit and the split model, and replicated tensors agree across ranks)."""
    n_exp = model.config.n_routed_experts
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            g = torch.Generator(device=t.device).manual_seed(seed + zlib.crc32(name.encode()))
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "tid2eid":
                t.copy_(torch.rand(t.shape[0], n_exp, generator=g, device=t.device).argsort(-1)[:, :t.shape[1]])
            elif leaf.endswith("_scale"):
                t.copy_(torch.rand(t.shape, generator=g, device=t.device) + 0.5)
            elif name.endswith("norm.weight"):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g, device=t.device))
            elif leaf in ("bias", "attn_sink", "ape") or leaf.endswith("_base"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g, device=t.device))
            else:
                t.copy_(torch.randn(t.shape, generator=g, device=t.device) * t.shape[-1] ** -0.5)


def _correctness(config, comm, device) -> dict:
    tiny = json.loads((REPO / "dspark/configs/tiny-v4.json").read_text())
    prompts = [list(range(3, 14)), [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] + [4] * 9, [7] * 13]
    mine = [i for i in range(len(prompts)) if i % 2 == config.rank]
    ref_model = init_model(tiny, seed=0, device=device, dtype=torch.float32)
    states = [ref_model.new_state() for _ in prompts]
    ref = ref_model(torch.tensor(sum(prompts, []), device=device), states, [len(p) for p in prompts]).logits
    rows = torch.cat([torch.arange(sum(map(len, prompts[:i])), sum(map(len, prompts[:i + 1]))) for i in mine])
    ecfg = EngineConfig(max_running=4, draft_tokens=1, drafter="mtp")
    ref_tokens = _generate(Engine(ref_model, ecfg), prompts, range(len(prompts)), lambda e: e.has_work())
    model = init_model(tiny, seed=0, device=device, dtype=torch.float32)
    layers = parallelize(model, config, comm)
    states = [model.new_state() for _ in mine]
    out = model(torch.tensor(sum((prompts[i] for i in mine), []), device=device), states,
                [len(prompts[i]) for i in mine]).logits
    tokens = _generate(LockstepEngine(model, ecfg, comm, layers), prompts, mine, lambda e: e.has_work_anywhere())
    return {"max_abs_logit_diff": float((out - ref[rows.to(device)]).abs().max()),
            "greedy_tokens_identical": all(tokens[i] == ref_tokens[i] for i in mine), "requests": mine}


def _generate(engine, prompts, which, more) -> dict:
    ids = {engine.add_request(prompts[i], SamplingParams(temperature=0.0), 12): i for i in which}
    out = {i: [] for i in which}
    while more(engine):
        for event in engine.step():
            out[ids[event.request_id]] += event.new_token_ids
    return out


def _decode_rate(model, batch: int, device, seed: int) -> dict:
    """Prefill `batch` requests of CONTEXT tokens, then time greedy decode steps."""
    g = torch.Generator(device=device).manual_seed(seed)
    states = [model.new_state() for _ in range(batch)]
    ids = torch.randint(0, 256, (batch * CONTEXT,), generator=g, device=device)
    t0 = time.perf_counter()
    for lo in range(0, batch, 32):  # prefill in groups of 32 requests
        hi = min(batch, lo + 32)
        logits = model(ids[lo * CONTEXT:hi * CONTEXT], states[lo:hi], [CONTEXT] * (hi - lo)).logits
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    nxt = torch.randint(0, 256, (batch,), generator=g, device=device)
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        nxt = model(nxt, states, [1] * batch).logits.argmax(-1)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"batch_per_gpu": batch, "prefill_s": prefill_s, "decode_steps": STEPS, "decode_s": elapsed,
            "step_ms": 1e3 * elapsed / STEPS, "tokens_per_s_per_gpu": batch * STEPS / elapsed}


def _throughput(config, comm, device, started: float) -> list[dict]:
    mini = json.loads((REPO / "dspark/configs/v4-mini.json").read_text())
    rows = []
    for layout in ("one_gpu", "dep2"):
        model = build_model(mini, device, torch.bfloat16)
        if layout == "dep2":
            parallelize(model, config, comm)
        _random_fill(model, seed=0)
        model.eval().requires_grad_(False)
        for batch in BATCHES:
            skip = torch.tensor([time.perf_counter() - started > TIME_BUDGET_S], device=device)
            dist.all_reduce(skip, op=dist.ReduceOp.MAX)  # both ranks skip together (DEP2 is collective)
            if skip.item():
                rows.append({"layout": layout, "batch_per_gpu": batch, "skipped": "time budget"})
                continue
            with torch.inference_mode():
                rows.append({"layout": layout, **_decode_rate(model, batch, device, seed=config.rank)})
            print(f"rank {config.rank} {rows[-1]}", flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    started = time.perf_counter()
    config = ParallelConfig(world_size=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]),
                            local_rank=int(os.environ["LOCAL_RANK"]), ep=2, dp_attention=True, backend="nccl")
    comm = init_distributed(config)
    device = torch.device("cuda", config.local_rank)
    try:
        with torch.inference_mode():
            check = _correctness(config, comm, device)
        print(f"rank {config.rank} correctness {check}", flush=True)
        rows = _throughput(config, comm, device, started)
        gathered = [None, None] if config.rank == 0 else None
        dist.gather_object({"correctness": check, "throughput": rows}, gathered, dst=0)
    finally:
        shutdown()
    if config.rank == 0:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
        result = {
            "bench": "dist_x2", "commit": commit or None, "gpu": torch.cuda.get_device_name(0), "gpus": 2,
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
            "model": "v4-mini (dspark/configs/v4-mini.json), random weights, bf16",
            "context_tokens": CONTEXT, "context_source": "real prefill of random tokens (no fabricated state)",
            "decoding": "plain greedy, one token per request per step, no drafter", "warmup_steps": WARMUP,
            "moe": "torch reference expert loop in both layouts (fused kernels not used)",
            "ranks": gathered, "wall_s": time.perf_counter() - started,
        }
        out = Path(os.environ.get("OUT", REPO / "bench/results"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "dist_x2.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
