"""dspark-tiny: where "auto" spends its time against plain decoding, step by step.

    python bench/tiny_round_split.py --out bench/results/tiny-round-split.json [--device cuda]
        [--batch 4] [--temperature 1] [--capacity TABLE.json]

One engine per budget (0 and "auto", built and warmed as `bench/tiny_auto.py` builds them) decodes the
first `--prompts` HumanEval prompts of the shipped subset, `--batch` at a time; every `Engine.step()` is
timed and sorted by what it ran, from the round trace: a step with a prompt chunk ("prefill"), a decoding
round that verified no draft ("plain") or one that did ("drafting"). Per kind: steps, total and median
ms. Both engines keep a trace (a record per request per round), which `bench/tiny_auto.py`'s do not.
`--profile`: afterwards each engine serves the first batch once more under `torch.profiler` (host and
device), and the JSON gets the ops with the most host time and with the most device time, per step.
An auto engine's plain round runs the target plus what keeps the drafter current: set against the
plain engine's round it prices that upkeep; its drafting rounds' count and cost price its drafting.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

import dspark
from dspark.evaluate import encode_prompt, load_prompts
from dspark.profile import device_name
from dspark.sampling import SamplingParams
from dspark.verify.capacity import CapacityTable
from provenance import git_commit
from tiny_auto import build_engine, run_parser


def timed_steps(engine, prompts, temperature: float, seed: int, max_new_tokens: int) -> dict[str, list[float]]:
    """Serve `prompts` together; the wall ms of every step, by kind."""
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature, seed=seed + i), max_new_tokens)
    kinds: dict[str, list[float]] = {"prefill": [], "plain": [], "drafting": []}
    while engine.has_work():
        prefilling = any(r.in_prefill for r in engine.running)
        start = time.perf_counter()
        engine.step()
        ms = 1e3 * (time.perf_counter() - start)
        records = engine.take_trace()
        kind = "prefill" if prefilling or not records else \
            "drafting" if any(r["verified"] for r in records) else "plain"
        kinds[kind].append(ms)
    return kinds


def profiled_ops(engine, prompts, temperature: float, max_new_tokens: int, top: int = 25) -> dict:
    """Serve `prompts` once under torch.profiler: steps, and the `top` ops by self host time and by self
    device time, each op's count and microseconds per step (what a round launches and where it waits)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.model.device.type == "cuda" else [])
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature, seed=i), max_new_tokens)
    steps = 0
    with profile(activities=activities) as prof:
        while engine.has_work():
            engine.step()
            steps += 1
    engine.take_trace()
    ops = [{"name": e.key, "count": e.count, "self_host_us": e.self_cpu_time_total / steps,
            "self_device_us": getattr(e, "self_device_time_total", 0.0) / steps} for e in prof.key_averages()]
    return {"steps": steps,
            "host_us_per_step": sum(o["self_host_us"] for o in ops),
            "device_us_per_step": sum(o["self_device_us"] for o in ops),
            "by_host": sorted(ops, key=lambda o: -o["self_host_us"])[:top],
            "by_device": sorted(ops, key=lambda o: -o["self_device_us"])[:top]}


def main() -> None:
    ap = run_parser(__doc__.split("\n")[0], prompts=8, batch=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--profile", action="store_true",
                    help="also serve the first batch once per engine under torch.profiler (ops by host / device time)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = dspark.load_model("tiny", device=args.device)
    prompts = [encode_prompt(model, t) for t in load_prompts("humaneval")[:args.prompts]]
    capacity = CapacityTable.load(args.capacity) if args.capacity else None
    engines = {b: build_engine(model, b, args.batch, prompts, args.max_new_tokens, capacity, trace=True,
                               temperatures=(args.temperature,)) for b in (0, "auto")}
    cells = {b: {"prefill": [], "plain": [], "drafting": []} for b in engines}
    for r in range(args.repeats):
        for b, engine in engines.items():
            for i in range(0, len(prompts), args.batch):
                got = timed_steps(engine, prompts[i:i + args.batch], args.temperature, 1000 * r + i,
                                  args.max_new_tokens)
                for kind, ms in got.items():
                    cells[b][kind] += ms
    rows = [{"draft_tokens": b, "kind": kind, "steps": len(ms), "total_ms": sum(ms),
             "median_ms": statistics.median(ms) if ms else None}
            for b, kinds in cells.items() for kind, ms in kinds.items()]
    profiles = ({str(b): profiled_ops(engine, prompts[:args.batch], args.temperature, args.max_new_tokens)
                 for b, engine in engines.items()} if args.profile else None)
    result = {"bench": "tiny_round_split", "conditions": {
        "device": device_name(model.device), "threads": args.threads, "torch": torch.__version__,
        "commit": git_commit(dirty=True), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": "tiny",
        "drafter": "dspark", "prompts": f"humaneval (shipped subset): {len(prompts)} prompts", "batch": args.batch,
        "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "capacity": capacity.label if capacity else "engine default"}, "rows": rows,
        **({"profiles": profiles} if profiles else {})}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        med = "-" if row["median_ms"] is None else f"{row['median_ms']:.3f}"
        print(f"n={row['draft_tokens']!s:>4} {row['kind']:>8}: {row['steps']:5d} steps, "
              f"{row['total_ms']:9.1f} ms, median {med} ms")
    for b, prof in (profiles or {}).items():
        print(f"n={b}: {prof['steps']} steps, {prof['host_us_per_step']:.0f} us host, "
              f"{prof['device_us_per_step']:.0f} us device per step (self times)")


if __name__ == "__main__":
    main()
