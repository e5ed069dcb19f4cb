"""FP8 MoE experts on one GPU: the tensor-core decode GEMV and the packed path's scale-after-dot.

    python bench/moe_fp8.py --out $OUT/moe-fp8.json            # one H200, ~3 min (compiles dominate)
    python bench/moe_fp8.py --smoke --out /tmp/moe-fp8.json     # tiny sweep, seconds of GPU time

For the V4-Flash layer (D 4096, I 2048, top-6 of 256 + shared) and v4-mini (D 2048, I 512, top-6 of
64), FP8 weights with 128×128 (V4) and 32×32 (V4.1 MXFP8-style) UE8M0 blocks, in one process:

* decode path (M = 1 and 8 tokens; `moe_decode`): the shipped CUDA-core GEMV (`decode_tiles`)
  against the tensor-core GEMV (`DecodeTiles(mma=True)`), each kernel swept alone over output rows
  × reduction step × warps, then the whole op with the shipped tiles and with the best MMA pair;
* packed path (M = 16, 64, 256; `moe._packed_experts`): FP8 tiles dequantised before the dot
  (`fp8_scale_after=False`, the earlier kernels) against scaled after it (the default).

Timing: CUDA-graph replays with L2 flushed (`bench.attn_batched.graph_timer`), so launch overhead
is excluded as inside the captured decode step. Bytes: the touched experts' weights and scales, the
shared expert, x and y; % HBM against 4.4 TB/s. Errors: relative to `moe_experts_ref` on the same
FP8 weights (fp32 math there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe_decode_tiles import HBM, LAYERS, TOP_K, nbytes  # noqa: E402

MMA_N, MMA_WARPS = (16, 32, 64), (4, 8)  # reduction steps: moe_decode.MMA_STEPS[block]


def fp8_weights(dim, inter, n_exp, block, g):
    from dspark.kernels.fp8 import FP8BlockWeight

    shapes = ((n_exp, inter, dim), (n_exp, dim, inter), (n_exp, inter, dim), (inter, dim), (dim, inter), (inter, dim))
    return [FP8BlockWeight.quantize(torch.randn(*s, generator=g, device="cuda") * s[-1] ** -0.5, block) for s in shapes]


def problem(name, block, m, g):
    """(x, wts, ids, weights, bytes) of one layer at M tokens."""
    dim, inter, n_exp = LAYERS[name]
    w = fp8_weights(dim, inter, n_exp, block, g)
    x = torch.randn(m, dim, generator=g, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(n_exp, device="cuda")[:TOP_K] for _ in range(m)]).int()
    wts = torch.rand(m, TOP_K, generator=g, device="cuda") + 0.1
    touched = int(torch.unique(ids).numel())
    n_bytes = sum(nbytes(t, touched) for t in w[:3]) + sum(nbytes(t, 1) for t in w[3:]) + 2 * x.numel() * 2
    return x, wts, ids, w, n_bytes, touched


def rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def decode_rows(name, block, m, g, timer, smoke: bool) -> dict:
    from dspark.kernels import moe, moe_decode as md

    x, wts, ids, w, n_bytes, touched = problem(name, block, m, g)
    w1, w2, w3, s1, s2, s3 = w
    ref = moe.moe_experts_ref(x, wts, ids, *w, swiglu_limit=10.0)
    shipped = md.decode_tiles(m, True, x.shape[1])
    ship_h, args = md.decode_up(x, ids, w1, w3, s1, s3, 10.0, shipped)
    ups, downs = [], []
    ns, ks, warps = ((16,), md.MMA_STEPS[block][:1], (4,)) if smoke else (MMA_N, md.MMA_STEPS[block], MMA_WARPS)
    for n, k, wp in itertools.product(ns, ks, warps):
        t = md.DecodeTiles(up_n=n, up_k=k, up_warps=wp, down_n=n, down_k=k, down_warps=wp, mma=True)
        h, _ = md.decode_up(x, ids, w1, w3, s1, s3, 10.0, t)
        s = timer(lambda: md.decode_up(x, ids, w1, w3, s1, s3, 10.0, t))
        ups.append({"n": n, "k": k, "warps": wp, "us": s * 1e6, "rel_err_vs_shipped_h": rel(h, ship_h)})
        y = md.decode_down(ship_h, x, wts, ids, w2, s2, args, t)
        s = timer(lambda: md.decode_down(ship_h, x, wts, ids, w2, s2, args, t))
        downs.append({"n": n, "k": k, "warps": wp, "us": s * 1e6, "rel_err": rel(y, ref)})
    bu, bd = min(ups, key=lambda r: r["us"]), min(downs, key=lambda r: r["us"])
    best = md.DecodeTiles(up_n=bu["n"], up_k=bu["k"], up_warps=bu["warps"], down_n=bd["n"], down_k=bd["k"],
                          down_warps=bd["warps"], mma=True)
    out = {}
    for label, tiles in (("shipped", shipped), ("mma", best)):
        y = md.decode_experts(x, wts, ids, *w, 10.0, tiles=tiles)
        s = timer(lambda: md.decode_experts(x, wts, ids, *w, 10.0, tiles=tiles))
        out[label] = {"tiles": tiles._asdict(), "us": s * 1e6, "pct_hbm": 100 * n_bytes / s / HBM, "rel_err": rel(y, ref)}
    out["speedup"] = out["shipped"]["us"] / out["mma"]["us"]
    return {"layer": name, "block": block, "M": m, "path": "decode", "touched_experts": touched, "bytes": n_bytes,
            **out, "up": ups, "down": downs}


def packed_row(name, block, m, g, timer) -> dict:
    from dspark.kernels import moe

    x, wts, ids, w, n_bytes, touched = problem(name, block, m, g)
    ref = moe.moe_experts_ref(x, wts, ids, *w, swiglu_limit=10.0)
    out = {}
    for label, after in (("scale_before", False), ("scale_after", True)):
        y = moe._packed_experts(x, wts, ids, *w, 10.0, fp8_scale_after=after)
        s = timer(lambda: moe._packed_experts(x, wts, ids, *w, 10.0, fp8_scale_after=after))
        out[label] = {"us": s * 1e6, "pct_hbm": 100 * n_bytes / s / HBM, "rel_err": rel(y, ref)}
    out["speedup"] = out["scale_before"]["us"] / out["scale_after"]["us"]
    return {"layer": name, "block": block, "M": m, "path": "packed", "touched_experts": touched, "bytes": n_bytes, **out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/moe-fp8.json")
    ap.add_argument("--layers", default=",".join(LAYERS), help=f"comma list of {tuple(LAYERS)}")
    ap.add_argument("--blocks", default="128,32", help="FP8 scale blocks: comma list of 128, 32")
    ap.add_argument("--decode-tokens", default="1,8")
    ap.add_argument("--packed-tokens", default="16,64,256")
    ap.add_argument("--smoke", action="store_true", help="one MMA shape, one layer and block, M = 1 and 16")
    args = ap.parse_args()
    layers = args.layers.split(",")
    if not set(layers) <= set(LAYERS):
        raise SystemExit(f"--layers: unknown {sorted(set(layers) - set(LAYERS))}; known {tuple(LAYERS)}")
    blocks = [int(b) for b in args.blocks.split(",")]
    if not set(blocks) <= {128, 32}:
        raise SystemExit(f"--blocks: {args.blocks!r}, expected a comma list of 128, 32")
    decode_m = [int(m) for m in args.decode_tokens.split(",") if m]
    packed_m = [int(m) for m in args.packed_tokens.split(",") if m]
    if args.smoke:
        layers, blocks, decode_m, packed_m = layers[:1], blocks[:1], [1], [16]
    from bench.attn_batched import graph_timer

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, block in itertools.product(layers, blocks):
        for m in decode_m:
            r = decode_rows(name, block, m, g, graph_timer, args.smoke)
            rows.append(r)
            print(f"{name} FP8-{block} M={m} decode: shipped {r['shipped']['us']:.1f} us ({r['shipped']['pct_hbm']:.0f} %), "
                  f"mma {r['mma']['us']:.1f} us ({r['mma']['pct_hbm']:.0f} %) {r['mma']['tiles']}, "
                  f"err {r['shipped']['rel_err']:.1e} / {r['mma']['rel_err']:.1e}", flush=True)
        for m in packed_m:
            r = packed_row(name, block, m, g, graph_timer)
            rows.append(r)
            print(f"{name} FP8-{block} M={m} packed: before {r['scale_before']['us']:.1f} us "
                  f"({r['scale_before']['pct_hbm']:.0f} %), after {r['scale_after']['us']:.1f} us "
                  f"({r['scale_after']['pct_hbm']:.0f} %), err {r['scale_after']['rel_err']:.1e}", flush=True)
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm_bytes_per_s": HBM,
                  "timing": "graph_timer (CUDA-graph replays, L2 flushed)", "smoke": args.smoke}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"conditions": conditions, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
