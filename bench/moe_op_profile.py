"""Where issue 6's decode MoE op spends its time: each kernel's duration and the gaps between them.

    python bench/moe_op_profile.py --out $OUT/moe-op-profile.json      # ~2 min on one H100 / H200

Per layer (V4-Flash, v4-mini), weight kind (bf16, FP8 128×128, FP8 32×32) and token count (1, 8), the
whole op of `bench/kernels.py`'s `fused_moe*` cases (router included, the same inputs and byte
counts) is captured in a CUDA graph after an L2 flush, twice: with the decode tables as shipped
(`shipped`) and with every TMA / one-launch entry taken out (`gemv`: `UP_TMA` None, `DOWN_TMA` and
`FUSED` empty, the GEMV kernels of the thirty-eighth session). Each graph is replayed `--reps` times
under `torch.profiler`; the trace gives every kernel and memset of every replay. Per replay position
(the k-th device activity after the flush) the JSON has the name, the median duration and the median
idle gap before it; `span_us` is the first start to the last end, `busy_us` the sum of durations.
`graph_us` is the same op by `graph_timer` outside the profiler (CUPTI tracing may change launch
overlap, PDL included, so the span and `graph_us` are both kept).

Why: at one token, kernel-alone gains of the TMA gate/up, the TMA down and the one-launch kernels
vanished in the op (bench/README.md, fortieth session); this says whether the router, a gap, or the
kernels themselves take the time in the op.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attn_batched import copy_bytes_per_s, graph_timer  # noqa: E402
from graph_timing import capture  # noqa: E402
from moe_decode_tma import AB_LAYERS, AB_OPS  # noqa: E402
from provenance import git_commit  # noqa: E402

FLUSH_NAME = "bitwise_not"  # the flush's kernel: an op the MoE never runs, so replays split on it


def activities(trace: dict) -> list[dict]:
    """The device kernels and memsets of a chrome trace, in start order: dicts of name, ts, dur (µs)."""
    kinds = {"kernel", "gpu_memset"}
    rows = [{"name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0))}
            for e in trace.get("traceEvents", []) if e.get("cat") in kinds and e.get("ph") == "X"]
    return sorted(rows, key=lambda r: r["ts"])


def replays(rows: list[dict]) -> list[list[dict]]:
    """`rows` split into replays: the activities after each flush kernel, up to the next one."""
    out: list[list[dict]] = []
    for r in rows:
        if FLUSH_NAME in r["name"]:
            out.append([])
        elif out:
            out[-1].append(r)
    return [r for r in out if r]


def summarize(runs: list[list[dict]]) -> dict:
    """Median duration and gap per activity position over replays of the same length (the common one)."""
    length = statistics.mode(len(r) for r in runs)
    runs = [r for r in runs if len(r) == length]
    steps = []
    for k in range(length):
        gaps = [r[k]["ts"] - (r[k - 1]["ts"] + r[k - 1]["dur"]) for r in runs] if k else [0.0]
        steps.append({"name": runs[0][k]["name"][:120], "dur_us": statistics.median(r[k]["dur"] for r in runs),
                      "gap_before_us": statistics.median(gaps)})
    spans = [r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in runs]
    return {"replays": len(runs), "span_us": statistics.median(spans),
            "busy_us": sum(s["dur_us"] for s in steps), "steps": steps}


def profile(fn, reps: int) -> dict:
    """fn captured after an L2 flush (a 256 MB bitwise_not) and replayed `reps` times under the profiler."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    graph = capture(lambda: (torch.bitwise_not(flush, out=flush), fn()))
    graph.replay()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return summarize(replays(activities(trace)))


def sides() -> dict:
    """label -> a function that sets the decode tables for that side (`shipped`: as imported)."""
    from dspark.kernels import moe_decode as md

    up, down, fused = md.UP_TMA, dict(md.DOWN_TMA), dict(md.FUSED)

    def shipped():
        md.UP_TMA = up
        md.DOWN_TMA.clear()
        md.DOWN_TMA.update(down)
        md.FUSED.clear()
        md.FUSED.update(fused)

    def gemv():
        md.UP_TMA = None
        md.DOWN_TMA.clear()
        md.FUSED.clear()

    return {"shipped": shipped, "gemv": gemv}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/moe-op-profile.json")
    ap.add_argument("--layers", default="v4-flash,v4-mini")
    ap.add_argument("--kinds", default="fp8,fp8-32,bf16")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    import kernels as kb

    copy_bps = copy_bytes_per_s(torch.device("cuda"))
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit(),
                  "copy_bytes_per_s": copy_bps, "reps": args.reps,
                  "timing": "torch.profiler over CUDA-graph replays after a 256 MB L2 flush; graph_us by "
                            "graph_timer (median of 50) outside the profiler"}
    rows, layers, put = [], {}, sides()
    try:
        for name, kind, m in itertools.product(args.layers.split(","), args.kinds.split(","),
                                               [int(t) for t in args.tokens.split(",")]):
            shape = kb.CONFIGS[AB_LAYERS[name]]
            if shape.name not in layers:
                layers[shape.name] = kb.build_layer(shape, "cuda")
            fused, _, n_bytes, _ = kb.moe_case(AB_OPS[kind], shape, layers[shape.name], m, "cuda")
            for label, set_tables in put.items():
                set_tables()
                p = profile(fused, args.reps)
                graph_s = graph_timer(fused)
                rows.append({"layer": name, "op": AB_OPS[kind], "M": m, "side": label, "bytes": n_bytes,
                             "graph_us": graph_s * 1e6, "pct_copy": 100 * n_bytes / graph_s / copy_bps, **p})
                steps = ", ".join(f"{s['name'][:28]} {s['dur_us']:.1f} (+{s['gap_before_us']:.1f})"
                                  for s in p["steps"])
                print(f"{name} {AB_OPS[kind]} M={m} {label}: graph {graph_s * 1e6:.1f} us, span {p['span_us']:.1f}, "
                      f"busy {p['busy_us']:.1f}: {steps}", flush=True)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({"conditions": conditions, "results": rows}, indent=1) + "\n")
    finally:
        put["shipped"]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
