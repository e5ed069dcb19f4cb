"""The decode router's select kernel: its warps and the one-reduction gather of the picked scores.

    python bench/route_select.py --out bench/results/route-select-h200.json      # one GPU, ~2 min

The select kernel is one program per token: it sums the logits kernel's fp32 partials, then picks K
experts by K argmax rounds. At one V4-Flash FP8 token it ended 4.2 µs after the logits kernel on an H100
(`moe-aside-diag-h100-s37.json`'s timeline), on the critical path of every MoE layer. This times
`RouteTiles(select_warps=, gather_once=)` (the same bits at every value: tests) for the router alone and
for the whole MoE op (that router, then `moe.moe_experts`, which is what `moe.fused_moe` runs), as
CUDA-graph replays with L2 flushed (`bench.attn_batched.graph_timer`), the variants in turn over
`--rounds` rounds (median).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "bench"):  # bench/kernels.py imports `provenance` from its own folder
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench.attn_batched import graph_timer  # noqa: E402
from bench.kernels import CONFIGS, build_layer, conditions  # noqa: E402
from provenance import git_commit  # noqa: E402
from dspark.kernels import moe, moe_route_decode  # noqa: E402

CASES = (("flash", "fp8_128", 1), ("flash", "fp8_32", 1), ("flash", "fp8_32", 8), ("mini", "bf16", 1),
         ("mini", "bf16", 8))
VARIANTS = tuple(moe_route_decode.RouteTiles(select_warps=w, gather_once=g)
                 for w, g in itertools.product((None, 1, 2), (False, True)))


def label(tiles: moe_route_decode.RouteTiles) -> str:
    return f"warps={tiles.select_warps or 'rule'} gather_once={int(tiles.gather_once)}"


def calls(shape, layer: dict, weights: tuple, x: torch.Tensor, tiles):
    """(router alone, whole op) at `tiles` as no-argument calls."""
    router = (x, layer["gate"], layer["bias"], None, None)
    kw = dict(top_k=shape.top_k, routed_scaling_factor=1.5, hash_routing=False)

    def route():
        return moe_route_decode.route_decode(*router, **kw, tiles=tiles)

    def op():
        return moe.moe_experts(x, *route(), *weights, swiglu_limit=10.0)
    return route, op


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/route-select.json")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds over the variants, in turn")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/route_select.py needs a CUDA GPU", file=sys.stderr)
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
        want = calls(shape, layer, weights, x, VARIANTS[0])[1]()
        for tiles in VARIANTS[1:]:  # every variant computes the shipped op's bits
            assert torch.equal(calls(shape, layer, weights, x, tiles)[1](), want), tiles
        times = {label(t): {"route": [], "op": []} for t in VARIANTS}
        for _ in range(args.rounds):
            for tiles in VARIANTS:
                route, op = calls(shape, layer, weights, x, tiles)
                times[label(tiles)]["route"].append(graph_timer(route) * 1e6)
                times[label(tiles)]["op"].append(graph_timer(op) * 1e6)
        case = {"layer": shape.name, "weights": kind, "M": m, "all_us": times,
                "us": {v: {part: statistics.median(t) for part, t in parts.items()} for v, parts in times.items()}}
        result["cases"].append(case)
        for v, us in case["us"].items():
            print(f"{shape.name} {kind} M={m} {v}: router {us['route']:.2f} us, op {us['op']:.2f} us", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
