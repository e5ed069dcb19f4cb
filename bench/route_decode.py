"""MoE router paths on one GPU: the split-K decode router vs the prefill kernel vs the torch reference.

    python bench/route_decode.py --out $OUT/route-decode.json        # one H200, ~1-2 min
    python bench/route_decode.py --smoke --out /tmp/route.json       # CPU (Triton interpreter), tiny shapes

For v4-mini (D 2048, top-6 of 64 experts) and V4-Flash (D 4096, top-6 of 256), bf16 x and gate,
score routing, at M = 1, 8, 64, 256, 4096 tokens it times `moe_route_decode.route_decode` (default
`RouteTiles`), `moe.route_prefill` (the single-kernel router), `moe.moe_route` (the shipped dispatch:
decode up to `ROUTE_DECODE_MAX_TOKENS`) and `moe.moe_route_ref`. Then it sweeps `RouteTiles` for the
decode path at M <= 256 and names the fastest per (layer, M).

Timing: each call is captured `--reps` times in one CUDA graph (decode steps run as graphs, so no
Python launch cost is counted); the graph is replayed 5 times and the median replay / reps is kept.
`warm_us`: the gate weights stay in L2 between calls; `cold_us`: each call follows a write of
128 MiB (> the 50 MB L2), and a graph of the writes alone is subtracted. Every path's ids are
compared with the reference's (the share of tokens with the same expert set) and with the prefill
kernel's, and the largest weight difference on agreeing tokens is reported.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from any directory
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.graph_timing import capture, replay_seconds  # noqa: E402

LAYERS = {"v4-mini": (2048, 64), "v4-flash": (4096, 256)}  # D, E
TOP_K = 6
TOKENS = (1, 8, 64, 256, 4096)
SWEEP = [(e, k, p, w) for e, k, p, w in itertools.product((16, 32, 64), (64, 128), (128, 256), (4,))]
SMOKE_LAYERS = {"tiny": (96, 72)}
SMOKE_TOKENS = (1, 3)
SMOKE_SWEEP = [(16, 16, 8, 4), (32, 64, 128, 4)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/route-decode.json")
    p.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, wall-clock timing")
    return p.parse_args(argv)


def conditions(smoke: bool) -> dict:
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=REPO, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
            "smoke": smoke, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "dtype": "bfloat16", "top_k": TOP_K}


def inputs(n_tok: int, dim: int, n_exp: int, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, dim, generator=g).to(device, torch.bfloat16)
    gate = (torch.randn(n_exp, dim, generator=g) * dim ** -0.5).to(device, torch.bfloat16)
    bias = (torch.randn(n_exp, generator=g) * 0.1).to(device)
    return x, gate, bias, None, None


class GraphTimer:
    """Per-call µs of fn() in a CUDA graph of `reps` calls, warm (weights in L2) and cold (L2 written over)."""

    def __init__(self, reps: int):
        self.reps = reps
        self.flush = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        self.flush_s = None  # one graph of the writes alone, measured once

    def _replay_s(self, body) -> float:
        return replay_seconds(capture(body), 5)

    def __call__(self, fn) -> dict:
        def warm():
            for _ in range(self.reps):
                fn()

        def cold(with_fn=True):
            for _ in range(self.reps):
                self.flush.zero_()
                if with_fn:
                    fn()

        if self.flush_s is None:
            self.flush_s = self._replay_s(lambda: cold(False))
        return {"warm_us": self._replay_s(warm) / self.reps * 1e6,
                "cold_us": (self._replay_s(cold) - self.flush_s) / self.reps * 1e6}


def wall_timer(fn) -> dict:
    """Smoke mode: one interpreted call's wall time (checks the plumbing, not the GPU)."""
    start = time.perf_counter()
    fn()
    return {"warm_us": (time.perf_counter() - start) * 1e6, "cold_us": None}


def agreement(out, ref) -> dict:
    """Share of tokens with the same expert set, and the largest weight difference on those tokens."""
    same = (out[1].sort(-1).values == ref[1].sort(-1).values).all(-1)
    diff = (out[0].sort(-1).values - ref[0].sort(-1).values)[same].abs()
    return {"same_experts": same.float().mean().item(), "max_abs_w_diff": diff.max().item() if diff.numel() else 0.0}


def paths(moe, rd):
    kw = dict(top_k=TOP_K, routed_scaling_factor=1.5, hash_routing=False)
    return {"ref": lambda a: moe.moe_route_ref(*a, **kw), "prefill": lambda a: moe.route_prefill(*a, **kw),
            "decode": lambda a: rd.route_decode(*a, **kw), "moe_route": lambda a: moe.moe_route(*a, **kw)}, kw


def run(args) -> dict:
    from dspark.kernels import moe
    from dspark.kernels import moe_route_decode as rd

    device = "cpu" if args.smoke else "cuda"
    timer = wall_timer if args.smoke else GraphTimer(args.reps)
    layers, tokens, sweep = (SMOKE_LAYERS, SMOKE_TOKENS, SMOKE_SWEEP) if args.smoke else (LAYERS, TOKENS, SWEEP)
    fns, kw = paths(moe, rd)
    rows, sweep_rows = [], []
    for (name, (dim, n_exp)), m in itertools.product(layers.items(), tokens):
        a = inputs(m, dim, n_exp, device, seed=m)
        ref, prefill = fns["ref"](a), fns["prefill"](a)
        row = {"layer": name, "D": dim, "E": n_exp, "M": m, "decode_plan": rd.plan_route(m, dim, n_exp)._asdict()}
        for path, fn in fns.items():
            row[path] = {**timer(lambda: fn(a)), "vs_ref": agreement(fn(a), ref), "vs_prefill": agreement(fn(a), prefill)}
        row["decode_speedup_vs_prefill"] = row["prefill"]["warm_us"] / row["decode"]["warm_us"]
        rows.append(row)
        print(f"{name} M={m}: " + ", ".join(f"{p} {row[p]['warm_us']:.1f}/{row[p]['cold_us'] or 0:.1f} us"
                                          for p in fns) + " (warm/cold)", flush=True)
        if m > moe.ROUTE_DECODE_MAX_TOKENS:
            continue
        for tiles in map(lambda t: rd.RouteTiles(*t), sweep):
            call = lambda: rd.route_decode(*a, **kw, tiles=tiles)  # noqa: E731
            sweep_rows.append({"layer": name, "M": m, "tiles": tiles._asdict(),
                               "plan": rd.plan_route(m, dim, n_exp, tiles)._asdict(), **timer(call),
                               "vs_ref": agreement(call(), ref)})
    best = {}  # fastest cold (as in a decode step, where other layers' weights evict the gate)
    for r in sweep_rows:
        key, t = f"{r['layer']} M={r['M']}", r["warm_us"] if r["cold_us"] is None else r["cold_us"]
        if key not in best or t < best[key]["us"]:
            best[key] = {"tiles": r["tiles"], "us": t, "warm_us": r["warm_us"], "cold_us": r["cold_us"]}
    for key, b in best.items():
        print(f"best tiles {key}: {b}", flush=True)
    return {"conditions": conditions(args.smoke), "route_decode_max_tokens": moe.ROUTE_DECODE_MAX_TOKENS,
            "default_tiles": rd.RouteTiles()._asdict(), "results": rows, "sweep": sweep_rows, "best_tiles": best}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported
    elif not torch.cuda.is_available():
        print("route_decode.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    result = run(args)
    print(json.dumps(result["conditions"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
