"""W8A8 experts (`dspark/kernels/moe_w8a8.py`) against the weights-only FP8 path, V4-Flash MoE layer, one GPU.

For M tokens (bf16 x) and FP8 weights with 128×128 (V4) or 32×32 (V4.1) blocks, each case times,
with `triton.testing.do_bench` (CUDA events, L2 flushed before each run, median):

* ``weights_only``: the router, then `moe.moe_experts` (the shipped fused path: FP8 weight tiles
  dequantised to bf16 in registers, bf16 × bf16 dots);
* ``w8a8_inline``: the router, then `moe_w8a8.moe_experts_w8a8` quantising x itself;
* ``w8a8_side``: `W8A8MoeExperts.quantize_input` (x's quantisation on a side stream), the router, then the
  op: what the MoE layer runs with ``KernelConfig(moe_experts="w8a8")``;
* ``act_quant`` and ``route`` alone (what the side stream can hide).

TFLOP/s counts the experts' GEMMs, 2·M·(K+1)·3·I·D. Errors: W8A8 against its torch reference, and how
far the W8A8 arithmetic lies from the weights-only reference (the activations' fp8 error), at the
smallest M. ``--tiles`` also times the W8A8 experts at other launch shapes (BLOCK_M, BLOCK_N, up
warps, down warps, optionally Triton's pipeline stages) at the largest M.

    python bench/moe_w8a8.py --out bench/results/moe-w8a8.json
    python bench/moe_w8a8.py --tokens 512,4096 --blocks 128 --tiles 64x128x8x8,128x128x8x8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from any directory
    sys.path.insert(0, str(REPO))

from kernels import CONFIGS, build_layer, conditions, rel_err  # noqa: E402 (bench/ is on sys.path)
from provenance import git_commit  # noqa: E402

SHAPE = CONFIGS["flash"]  # D 4096, E 256, top-6, I 2048 (spec §2.2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="256,1024,4096,8192", help="comma-separated M")
    p.add_argument("--blocks", default="128,32", help="FP8 blocks of the weights")
    p.add_argument("--tiles", default="", help="extra W8A8 launch shapes BMxBNxUPWxDNW[xSTAGES], at the largest M")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--out", default="bench/results/moe-w8a8.json")
    return p.parse_args(argv)


def cases(layer: dict, block: int, m: int):
    """{name: thunk} of the compared paths at M tokens, and the inputs (x, weights, ids, experts)."""
    from dspark.kernels import moe, moe_w8a8

    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, SHAPE.dim, generator=gen, device="cuda").bfloat16()
    router = (x, layer["gate"], layer["bias"], None, None)
    route_kw = dict(top_k=SHAPE.top_k, routed_scaling_factor=1.5, hash_routing=False)
    ws = layer[f"fp8_{block}"]
    op = moe_w8a8.W8A8MoeExperts()

    def weights_only():
        w, ids = moe.moe_route(*router, **route_kw)
        return moe.moe_experts(x, w, ids, *ws, swiglu_limit=10.0)

    def w8a8_inline():
        w, ids = moe.moe_route(*router, **route_kw)
        return moe_w8a8.moe_experts_w8a8(x, w, ids, *ws, swiglu_limit=10.0)

    def w8a8_side():
        early = op.quantize_input(x, *ws)
        w, ids = moe.moe_route(*router, **route_kw)
        return op(x, w, ids, *ws, swiglu_limit=10.0, x_fp8=early)

    thunks = {"weights_only": weights_only, "w8a8_inline": w8a8_inline, "w8a8_side": w8a8_side,
              "act_quant": lambda: moe_w8a8.act_quant(x, block), "route": lambda: moe.moe_route(*router, **route_kw)}
    return thunks, (x, ws, *moe.moe_route(*router, **route_kw))


def errors(x, ws, w, ids) -> dict:
    """W8A8 against its reference, and the W8A8 arithmetic against the weights-only reference."""
    from dspark.kernels import moe, moe_w8a8

    out = moe_w8a8.moe_experts_w8a8(x, w, ids, *ws, swiglu_limit=10.0)
    ref = moe_w8a8.moe_experts_w8a8_ref(x, w, ids, *ws, swiglu_limit=10.0)
    weights_only = moe.moe_experts_ref(x, w, ids, *ws, swiglu_limit=10.0)
    return {"w8a8_vs_its_ref": rel_err(out, ref), "w8a8_ref_vs_weights_only_ref": rel_err(ref, weights_only),
            "weights_only_kernel_vs_ref": rel_err(moe.moe_experts(x, w, ids, *ws, swiglu_limit=10.0), weights_only)}


def main(argv=None) -> int:
    from triton.testing import do_bench

    from dspark.kernels import moe_w8a8

    args = parse_args(argv)
    timer = lambda fn: do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median") * 1e-3  # noqa: E731
    tokens = [int(t) for t in args.tokens.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    result = {"conditions": conditions(git_commit(dirty=True)), "layer": SHAPE.name, "rows": [], "errors": [],
              "tiles": []}
    print(json.dumps(result["conditions"]))
    layer = build_layer(SHAPE, "cuda")
    for block in blocks:
        for m in tokens:
            thunks, inputs = cases(layer, block, m)
            if m == tokens[0]:
                result["errors"].append({"block": block, "M": m, **errors(*inputs)})
                print(json.dumps(result["errors"][-1]))
            flop = 2 * m * (SHAPE.top_k + 1) * 3 * SHAPE.inter * SHAPE.dim
            times = {name: timer(fn) for name, fn in thunks.items()}
            row = {"block": block, "M": m, **{f"{k}_us": v * 1e6 for k, v in times.items()},
                   "w8a8_side_TFLOPs": flop / times["w8a8_side"] / 1e12,
                   "weights_only_TFLOPs": flop / times["weights_only"] / 1e12,
                   "speedup_side_vs_weights_only": times["weights_only"] / times["w8a8_side"],
                   "speedup_side_vs_inline": times["w8a8_inline"] / times["w8a8_side"]}
            result["rows"].append(row)
            print(json.dumps(row))
        if args.tiles:
            thunks, _ = cases(layer, block, tokens[-1])
            shipped = moe_w8a8._tiles
            for spec in args.tiles.split(","):
                tiles = tuple(int(v) for v in spec.split("x"))
                moe_w8a8._tiles = lambda rows, block, t=tiles: t if rows > 32 else shipped(rows, block)
                try:
                    row = {"block": block, "M": tokens[-1], "tiles": spec, "w8a8_inline_us": timer(thunks["w8a8_inline"]) * 1e6}
                except Exception as error:  # noqa: BLE001 (a shape that does not compile is a result too)
                    row = {"block": block, "M": tokens[-1], "tiles": spec, "error": f"{type(error).__name__}: {error}"[:300]}
                finally:
                    moe_w8a8._tiles = shipped
                result["tiles"].append(row)
                print(json.dumps(row))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
