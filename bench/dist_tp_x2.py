"""TP2 (attention heads + expert width split over two GPUs, NCCL) against one GPU: correctness and
small-batch decode step time.

    torchrun --nproc-per-node 2 bench/dist_tp_x2.py          # nvidia-h200-x2; JSON to $OUT/dist_tp_x2.json

Keep NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (set by default here). Without CUDA
it runs on gloo/CPU with the tiny model only (a smoke test of the script itself).

Part 1, correctness, every rank against its own single-process reference on the same device:
tiny V4 in fp32 and v4-mini in bf16 (random weights, seeded): max |Δ logit| of a ragged prefill,
the share of bit-identical logits, and greedy tokens of the engine (tiny: MTP drafter, 1 draft
token; v4-mini: plain greedy). Part 2, decode step time of v4-mini (bf16) at B = 1, 8, 32
requests (the same requests on both ranks, as TP runs them): (a) one GPU, the unsplit model;
(b) TP2. CONTEXT prompt tokens are prefilled for real, then STEPS greedy decode steps are timed
after WARMUP with CUDA synchronisation. Both use the torch reference kernels
(`KernelConfig.uniform("ref")`); TP2 takes the default `tp_epilogue="auto"`, i.e. the fused MoE
epilogue on GPUs (bench/dist_tp_fused_x2.py compares it with the unfused one).
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
from dspark.engine.engine import Engine, EngineConfig  # noqa: E402
from dspark.kernels import KernelConfig  # noqa: E402
from dspark.sampling import SamplingParams  # noqa: E402

CONTEXT, WARMUP, STEPS, BATCHES = 64, 2, 10, (1, 8, 32)
PROMPTS = [list(range(3, 14)), [5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] + [4] * 9, [7] * 13]
REF = KernelConfig.uniform("ref")


def _model(name: str, device, dtype, tp: tuple | None = None):
    """Seeded random model (same weights on every rank); parallelised when `tp` = (config, comm)."""
    model = init_model(name, seed=0, device=device, dtype=dtype, kernels=REF)
    if tp is not None:
        parallelize(model, *tp)
    return model


def _generate(model, engine_config, max_new: int) -> list[list[int]]:
    engine = Engine(model, engine_config)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0), max_new) for p in PROMPTS]
    out = {rid: [] for rid in ids}
    while engine.has_work():
        for event in engine.step():
            out[event.request_id] += event.new_token_ids
    return [out[rid] for rid in ids]


def _correctness(name: str, dtype, engine_config, tp, device) -> dict:
    """Prefill logits and greedy tokens, TP against one process."""
    result, logits, tokens = {"model": name, "dtype": str(dtype)}, [], []
    for split in (None, tp):
        model = _model(name, device, dtype, split)
        states = [model.new_state() for _ in PROMPTS]
        with torch.inference_mode():
            logits.append(model(torch.tensor(sum(PROMPTS, []), device=device), states,
                                [len(p) for p in PROMPTS]).logits)
            tokens.append(_generate(model, engine_config, 16))
        del model
    result["max_abs_logit_diff"] = float((logits[1] - logits[0]).abs().max())
    result["bit_identical_logit_share"] = float((logits[1] == logits[0]).float().mean())
    result["greedy_tokens_identical"] = tokens[0] == tokens[1]
    return result


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step_time(model, batch: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(batch)
    states = [model.new_state() for _ in range(batch)]
    ids = torch.randint(0, 256, (batch * CONTEXT,), generator=g, device=device)
    model(ids, states, [CONTEXT] * batch)
    nxt = torch.randint(0, 256, (batch,), generator=g, device=device)
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            _sync(device)
            t0 = time.perf_counter()
        nxt = model(nxt, states, [1] * batch).logits.argmax(-1)
    _sync(device)
    elapsed = time.perf_counter() - t0
    return {"batch": batch, "step_ms": 1e3 * elapsed / STEPS, "tokens_per_s": batch * STEPS / elapsed}


def main() -> int:
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    config = ParallelConfig(world_size=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]),
                            local_rank=int(os.environ["LOCAL_RANK"]), tp=2, backend="nccl" if cuda else "gloo")
    comm = init_distributed(config)
    device = torch.device("cuda", config.local_rank) if cuda else torch.device("cpu")
    tp = (config, comm)
    mtp = EngineConfig(max_running=4, draft_tokens=1, drafter="mtp")
    plain = EngineConfig(max_running=4, draft_tokens=0)
    try:
        checks = [_correctness("tiny-v4", torch.float32, mtp, tp, device)]
        rows = []
        if cuda:
            checks.append(_correctness("v4-mini", torch.bfloat16, plain, tp, device))
            for layout in ("one_gpu", "tp2"):
                model = _model("v4-mini", device, torch.bfloat16, tp if layout == "tp2" else None)
                with torch.inference_mode():
                    rows += [{"layout": layout, **_step_time(model, b, device)} for b in BATCHES]
                print(f"rank {config.rank} {rows[-len(BATCHES):]}", flush=True)
                del model
                torch.cuda.empty_cache()
        gathered = [None] * config.world_size if config.rank == 0 else None
        dist.gather_object({"correctness": checks, "decode": rows}, gathered, dst=0)
    finally:
        shutdown()
    if config.rank == 0:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
        result = {
            "bench": "dist_tp_x2", "commit": commit or None, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if cuda else None, "ranks_n": config.world_size,
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
            "kernels": "torch references in both layouts", "context_tokens": CONTEXT, "warmup_steps": WARMUP,
            "decode_steps": STEPS, "ranks": gathered, "wall_s": time.perf_counter() - started,
        }
        out = Path(os.environ.get("OUT", REPO / "bench/results"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "dist_tp_x2.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
