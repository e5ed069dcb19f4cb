"""The decode MoE through TMA (`dspark.kernels.moe_decode_tma`) against the shipped GEMV kernels.

    python bench/moe_decode_tma.py --out $OUT/moe-decode-tma.json           # one H100 / H200, ~4 min

Per layer (V4-Flash: D 4096, I 2048, top-6 of 256 plus the shared expert; v4-mini: D 2048, I 512,
top-6 of 64), weight kind (bf16, FP8 128×128, FP8 32×32) and token count (1, 8), in one process:

* the shipped kernels at their table's shape (`moe_decode.decode_tiles`): up alone, down alone, the
  experts op, and the whole op with the router (`moe.fused_moe`);
* the TMA kernels over `TILES` × `STAGES` (each kernel alone), then the experts op and the whole op
  (`moe.moe_route` + `moe_decode_tma.tma_experts`) at the best shape of each kernel.

Every time is a CUDA-graph replay with L2 flushed (`bench.attn_batched.graph_timer`), the median of
50. % HBM: the bytes the op must read (the picked experts' weights and scales, the activations, and
for the whole op the router's weights) over the time, against 4.4 TB/s and against this card's own
measured copy bandwidth (`copy_pct`). Outputs are checked against the shipped op (relative error).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attn_batched import copy_bytes_per_s, graph_timer  # noqa: E402
from moe_decode_tiles import KINDS, LAYERS, op_bytes, routed_tokens, weights  # noqa: E402
from provenance import git_commit  # noqa: E402

HBM = 4.4e12
TILES = ((16, 128, 4), (16, 256, 4), (16, 256, 8), (16, 512, 8), (32, 128, 4), (32, 128, 8), (32, 256, 8))
STAGES = (3, 5)
LIMIT = 10.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fits(tiles, block) -> bool:
    """Rows per program must divide the FP8 block (one scale row per program)."""
    return block is None or block % tiles[0] == 0


def sweep(name: str, block, m: int, g, copy_bps: float) -> dict:
    from dspark.kernels import moe, moe_decode as md, moe_decode_tma as mt

    dim, inter, n_exp = LAYERS[name]
    w1, w2, w3, s1, s2, s3 = weights(dim, inter, n_exp, block, g)
    x, wts, ids = routed_tokens(m, dim, n_exp, g)
    touched = int(torch.unique(ids).numel())
    up_bytes, down_bytes = op_bytes(w1, w2, w3, s1, s2, s3, touched, m, dim)
    shipped = md.decode_tiles(m, block, dim)
    h_ref, args = md.decode_up(x, ids, w1, w3, s1, s3, LIMIT, shipped)
    y_ref = md.decode_down(h_ref, x, wts, ids, w2, s2, args, shipped)

    def pct(n_bytes, s):
        return {"us": s * 1e6, "pct_hbm": 100 * n_bytes / s / HBM, "copy_pct": 100 * n_bytes / s / copy_bps}

    row = {"layer": name, "fp8_block": block, "M": m, "touched_experts": touched, "up_bytes": up_bytes,
           "down_bytes": down_bytes, "shipped_tiles": shipped._asdict(),
           "shipped_up": pct(up_bytes, graph_timer(lambda: md.decode_up(x, ids, w1, w3, s1, s3, LIMIT, shipped))),
           "shipped_down": pct(down_bytes, graph_timer(
               lambda: md.decode_down(h_ref, x, wts, ids, w2, s2, args, shipped))),
           "shipped_experts": pct(up_bytes + down_bytes, graph_timer(
               lambda: md.decode_experts(x, wts, ids, w1, w2, w3, s1, s2, s3, LIMIT, shipped)))}
    ups, downs = [], []
    for (n, k, warps), stages in itertools.product(TILES, STAGES):
        if not fits((n, k), block):
            continue
        t = mt.TmaTiles(n, k, warps, n, k, warps, stages)
        shape = {"n": n, "k": k, "warps": warps, "stages": stages}
        try:
            h, sizes = mt.tma_up(x, ids, w1, w3, s1, s3, LIMIT, t)
            y = mt.tma_down(h_ref, x, wts, ids, w2, s2, sizes, t)
        except Exception as e:  # noqa: BLE001 (a shape past the SM's resources: recorded, not timed)
            ups.append({**shape, "skipped": repr(e)[:200]})
            continue
        ups.append({**shape, **pct(up_bytes, graph_timer(lambda: mt.tma_up(x, ids, w1, w3, s1, s3, LIMIT, t))),
                    "rel_err": rel_err(h, h_ref)})
        downs.append({**shape, **pct(down_bytes, graph_timer(
            lambda: mt.tma_down(h_ref, x, wts, ids, w2, s2, sizes, t))), "rel_err": rel_err(y, y_ref)})
    best_up = min((r for r in ups if "us" in r), key=lambda r: r["us"])
    best_down = min(downs, key=lambda r: r["us"])
    best = mt.TmaTiles(best_up["n"], best_up["k"], best_up["warps"], best_down["n"], best_down["k"],
                       best_down["warps"], best_up["stages"])
    y_tma = mt.tma_experts(x, wts, ids, w1, w2, w3, s1, s2, s3, LIMIT, best)
    row.update(tma_up=ups, tma_down=downs, best_up=best_up, best_down=best_down, best_tiles=best._asdict(),
               tma_experts=pct(up_bytes + down_bytes, graph_timer(
                   lambda: mt.tma_experts(x, wts, ids, w1, w2, w3, s1, s2, s3, LIMIT, best))),
               tma_rel_err=rel_err(y_tma, y_ref))
    # The whole op with the router (V4-Flash's sqrt-softplus top-k over E experts).
    gate = (torch.randn(n_exp, dim, generator=g, device="cuda") * dim ** -0.5).bfloat16()
    bias = torch.randn(n_exp, generator=g, device="cuda") * 0.01
    route = dict(top_k=ids.shape[1], routed_scaling_factor=2.5, hash_routing=False)
    op_bytes_ = up_bytes + down_bytes + gate.numel() * 2

    def shipped_op():
        return moe.fused_moe(x, gate, bias, x, x, w1, w2, w3, s1, s2, s3, swiglu_limit=LIMIT, **route)

    def tma_op():
        r_w, r_ids = moe.moe_route(x, gate, bias, x, x, **route)
        return mt.tma_experts(x, r_w, r_ids, w1, w2, w3, s1, s2, s3, LIMIT, best)

    row.update(shipped_op=pct(op_bytes_, graph_timer(shipped_op)), tma_op=pct(op_bytes_, graph_timer(tma_op)),
               op_rel_err=rel_err(tma_op(), shipped_op()))
    row["speedup_experts"] = row["shipped_experts"]["us"] / row["tma_experts"]["us"]
    row["speedup_op"] = row["shipped_op"]["us"] / row["tma_op"]["us"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/moe-decode-tma.json")
    ap.add_argument("--layers", default="v4-flash,v4-mini")
    ap.add_argument("--kinds", default="fp8,fp8-32,bf16")
    ap.add_argument("--tokens", default="1,8")
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    copy_bps = copy_bytes_per_s(torch.device("cuda"))
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit(),
                  "hbm_bytes_per_s": HBM, "copy_bytes_per_s": copy_bps, "tiles": TILES, "stages": STAGES,
                  "timing": "graph_timer (CUDA-graph replays, L2 flushed, median of 50)"}
    rows = []
    for name, kind, m in itertools.product(args.layers.split(","), args.kinds.split(","),
                                           [int(t) for t in args.tokens.split(",")]):
        r = sweep(name, KINDS[kind], m, g, copy_bps)
        rows.append(r)
        print(f"{name} {kind} M={m}: experts shipped {r['shipped_experts']['us']:.1f} us "
              f"({r['shipped_experts']['pct_hbm']:.1f} %) tma {r['tma_experts']['us']:.1f} us "
              f"({r['tma_experts']['pct_hbm']:.1f} %) {r['speedup_experts']:.3f}x; op shipped "
              f"{r['shipped_op']['us']:.1f} tma {r['tma_op']['us']:.1f} ({r['tma_op']['pct_hbm']:.1f} %) "
              f"{r['speedup_op']:.3f}x; up {r['shipped_up']['us']:.1f} -> {r['best_up']['us']:.1f}, down "
              f"{r['shipped_down']['us']:.1f} -> {r['best_down']['us']:.1f}; best {tuple(r['best_tiles'].values())}; "
              f"err {r['tma_rel_err']:.1e}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"conditions": conditions, "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
