"""Why the decode MoE's shared expert on a side stream (`moe_decode.SharedAside`) is slower than in line.

    python bench/moe_aside_diag.py --out bench/results/moe-aside-diag-h200.json

The thirty-seventh session's first run (`bench/gpu_session37.sh a`, kernels-moe-aside-h200-s35.json) timed
the op with the shared expert aside 14 µs slower at one V4-Flash FP8 128×128 token (73.6 -> 87.7 µs). Every
decode kernel launches with PDL and releases its successor at once (`triton_compat.pdl_prologue`), so a
successor's programs park on the SMs while their predecessor runs; with the aside two chains park at
once. This times the op by CUDA-graph replays (L2 flushed, `bench.attn_batched.graph_timer`) in
variants that separate the causes, in one process:

    inline           fused_moe as shipped (the shared expert in the routed kernels)
    aside            SharedAside.start before routing, as `KernelConfig(moe_shared="triton")` runs it
    aside_side_nopdl the same, the two side-stream kernels launched without PDL
    aside_late       the shared expert forked after the router (beside the routed up kernel only)
    aside_light      the side kernels at 512-wide reduction steps (fewer registers per program, so the
                     router's programs find room beside them; the shared sum's bits then differ from
                     in line by rounding)
    aside_light_nopdl both: light side kernels launched without PDL
    inline_nopdl, aside_nopdl: PDL off for every launch (`triton_compat.PDL`)
    shared_alone     the two shared-expert kernels alone (`moe_decode.decode_shared` at the op's tiles)
    routed_alone     the router and the routed kernels with the shared output made before the graph:
                     with `shared_alone`, what a perfect overlap would take (max(router, shared) + routed)

and, for `inline` and `aside`, each kernel's start and duration within one replay (torch.profiler,
median over replays) to show what overlaps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "bench"):  # bench/kernels.py imports `provenance` from its own folder
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench.attn_batched import graph_timer  # noqa: E402
from bench.graph_timing import capture  # noqa: E402
from bench.kernels import CONFIGS, build_layer, conditions  # noqa: E402
from provenance import git_commit  # noqa: E402
from dspark.kernels import moe, moe_decode, triton_compat  # noqa: E402

CASES = (("flash", "fp8_128", 1), ("flash", "bf16", 1), ("mini", "bf16", 8))
VARIANTS = ("inline", "aside", "aside_side_nopdl", "aside_late", "aside_light", "aside_light_nopdl",
            "inline_nopdl", "aside_nopdl", "shared_alone", "routed_alone")


@contextlib.contextmanager
def pdl_off(module):
    """`module.pdl_launch` answers False inside the block (the launches made there use no PDL)."""
    keep = module.pdl_launch
    module.pdl_launch = lambda device, programs: False
    try:
        yield
    finally:
        module.pdl_launch = keep


def thunk(variant: str, shape, layer: dict, weights: tuple, x: torch.Tensor):
    """The op of `variant` as a no-argument call (captured into a graph by the timers)."""
    router = (x, layer["gate"], layer["bias"], None, None)
    route_kw = dict(top_k=shape.top_k, routed_scaling_factor=1.5, hash_routing=False)
    if variant.startswith("inline"):
        return lambda: moe.fused_moe(*router, *weights, **route_kw, swiglu_limit=10.0)
    tiles = moe_decode._default_tiles(x, weights[0], shape.top_k)  # what SharedAside.start takes
    if variant == "shared_alone":
        return lambda: moe_decode.decode_shared(x, *weights[3:], 10.0, tiles)
    if variant == "routed_alone":
        made = moe_decode.PendingShared(None, moe_decode.decode_shared(x, *weights[3:], 10.0, tiles), tiles, ())

        def routed():
            w, i = moe.moe_route(*router, **route_kw)
            return moe.moe_experts(x, w, i, *weights, swiglu_limit=10.0, shared=made)
        return routed
    aside = moe_decode.SharedAside()

    def start():
        if variant.startswith("aside_light"):  # the routed kernels keep the op's tiles
            light = tiles._replace(up_k=min(tiles.up_k, 512), down_k=min(tiles.down_k, 512))
            with pdl_off(moe_decode) if variant.endswith("_nopdl") else contextlib.nullcontext():
                pending = aside.start(x, weights[0], *weights[3:], top_k=shape.top_k, swiglu_limit=10.0, tiles=light)
            return pending._replace(tiles=tiles)
        if variant == "aside_side_nopdl":
            with pdl_off(moe_decode):
                return aside.start(x, weights[0], *weights[3:], top_k=shape.top_k, swiglu_limit=10.0)
        return aside.start(x, weights[0], *weights[3:], top_k=shape.top_k, swiglu_limit=10.0)

    def run():
        if variant == "aside_late":
            w, i = moe.moe_route(*router, **route_kw)
            pending = start()
        else:
            pending = start()
            w, i = moe.moe_route(*router, **route_kw)
        return moe.moe_experts(x, w, i, *weights, swiglu_limit=10.0, shared=pending)
    return run


def timeline(fn, replays: int = 12, gap_us: float = 20.0) -> list[dict]:
    """Each kernel of one graph replay of fn: start offset from the replay's first kernel and duration,
    medians over `replays` (replays separated by a host sync; kernels ordered by median start)."""
    from torch.profiler import ProfilerActivity, profile

    graph = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
            time.sleep(1e-3)  # a gap the clustering below sees
    events = sorted((e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    groups, last_end = [], None
    for e in events:
        if last_end is None or e.time_range.start - last_end > gap_us:
            groups.append([])
        groups[-1].append(e)
        last_end = max(last_end or 0, e.time_range.end)
    per_kernel: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for g in groups:
        t0 = g[0].time_range.start
        for n, e in enumerate(g):
            per_kernel.setdefault((n, e.name[:80]), []).append((e.time_range.start - t0, e.time_range.elapsed_us()))
    rows = [{"kernel": name, "start_us": statistics.median(s for s, _ in v), "dur_us": statistics.median(d for _, d in v),
             "seen": len(v)} for (_, name), v in per_kernel.items()]
    return sorted(rows, key=lambda r: r["start_us"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/moe-aside-diag.json")
    p.add_argument("--rounds", type=int, default=2, help="timing rounds over the variants, in turn")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/moe_aside_diag.py needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {"conditions": conditions(git_commit()), "cases": []}
    layers: dict[str, dict] = {}
    for config, kind, m in CASES:
        shape = CONFIGS[config]
        if config not in layers:
            layers.clear()
            torch.cuda.empty_cache()
            layers[config] = build_layer(shape, "cuda")
        layer = layers[config]
        weights = layer[kind]
        x = torch.randn(m, shape.dim, generator=torch.Generator("cuda").manual_seed(m), device="cuda").bfloat16()
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for v in VARIANTS:
                triton_compat.PDL = v not in ("inline_nopdl", "aside_nopdl")
                try:
                    times[v].append(graph_timer(thunk(v, shape, layer, weights, x)) * 1e6)
                finally:
                    triton_compat.PDL = True
        case = {"layer": shape.name, "weights": kind, "M": m,
                "us": {v: statistics.median(t) for v, t in times.items()}, "us_all": times,
                "timeline": {v: timeline(thunk(v, shape, layer, weights, x)) for v in ("inline", "aside")}}
        result["cases"].append(case)
        print(json.dumps({k: case[k] for k in ("layer", "weights", "M", "us")}), flush=True)
        for v in ("inline", "aside"):
            print(f"  {v}:", "; ".join(f"{r['kernel'][:28]} @{r['start_us']:.1f}+{r['dur_us']:.1f}"
                                     for r in case["timeline"][v]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
