"""Launch-shape sweep of the packed MoE GEMMs (`dspark.kernels.moe`, the path above the decode GEMVs)
for FP8 and bf16 expert weights, on one GPU.

    PYTHONPATH=. python bench/moe_packed_tiles.py --out $OUT/moe-packed-tiles-h200.json   # one H200, ~4 min
    PYTHONPATH=. python bench/moe_packed_tiles.py --smoke --out /tmp/t.json              # one shape per kernel

The packed path at M = 64 read the V4-Flash layer's FP8 experts at 53 % of HBM (128×128 blocks) and
44 % (32×32; `bench/README.md`, fourteenth session) with tiles picked for bf16. For the V4-Flash
layer (D 4096, I 2048, top-6 of 256 + the shared expert) at M tokens, the routing packed once
(`moe._pack_assignments`), each of the two grouped GEMMs is timed alone (`moe._launch_up`,
`moe._launch_down`, routed experts) over BLOCK_N × BLOCK_K × warps at the shipped BLOCK_M, against
the shipped shape (`moe._tiles`); bytes are the touched experts' weights (+ scales) and the rows read
and written; % HBM against 4.4 TB/s. Timing: CUDA-graph replays with L2 flushed
(`bench.attn_batched.graph_timer`). Each candidate's output is compared with the shipped shape's over
the packed rows that hold an assignment (relative error). An FP8 K step either lies in one scale
block or covers whole ones (32×32 blocks in a 64- or 128-wide step take one factor per 32 columns).
The fifteenth session's run (`moe-packed-tiles-h200.json`) picked the shipped decode shapes; before
it a 32×32 block capped every FP8 step at 32.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.moe_decode_tiles import HBM, nbytes  # noqa: E402

DIM, INTER, EXPERTS, TOP_K = 4096, 2048, 256, 6
UP_N, UP_K, DOWN_N, DOWN_K, WARPS = (32, 64, 128), (32, 64, 128), (64, 128), (64, 128), (4, 8)


def weights(kind: str, g, device):
    from dspark.kernels.fp8 import FP8BlockWeight

    out = []
    for shape in ((EXPERTS, INTER, DIM), (EXPERTS, INTER, DIM), (EXPERTS, DIM, INTER)):  # w1, w3, w2
        w = torch.randn(*shape, generator=g, device=device) * shape[-1] ** -0.5
        out.append(w.bfloat16() if kind == "bf16" else FP8BlockWeight.quantize(w, int(kind.split("-")[1])))
    return out


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep(kind: str, m: int, g, device, timer, smoke: bool) -> dict:
    from dspark.kernels import moe

    w1, w3, w2 = weights(kind, g, device)
    x = torch.randn(m, DIM, generator=g, device=device).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, device=device)[:TOP_K] for _ in range(m)]).int()
    touched = int(torch.unique(ids).numel())
    n_assign = m * TOP_K
    shipped = moe._tiles(n_assign / min(EXPERTS, n_assign))
    block_m = shipped[0]
    rows, block_expert, _ = moe._pack_assignments(ids, EXPERTS, block_m)
    valid = rows < n_assign  # padding rows (sentinel N·K) are never written: compare the others
    up = lambda t: moe._launch_up(x, w1, w3, rows, block_expert, n_assign, rows.numel(), TOP_K, 10.0, t)  # noqa: E731
    h_ref = up(shipped)
    h_ref[~valid] = 0  # the down GEMM reads them (their outputs are dropped): keep them finite
    down = lambda t: moe._launch_down(h_ref, w2, block_expert, n_assign, t)  # noqa: E731
    y_ref = down(shipped)
    up_bytes = nbytes(w1, touched) + nbytes(w3, touched) + n_assign * DIM * 2 + h_ref.numel() * h_ref.element_size()
    down_bytes = nbytes(w2, touched) + h_ref.numel() * h_ref.element_size() + y_ref.numel() * 4
    grid_up = [((16,), (64,), (4,))] if smoke else [(UP_N, UP_K, WARPS)]
    grid_down = [((64,), (64,), (4,))] if smoke else [(DOWN_N, DOWN_K, WARPS)]
    ups, downs = [], []
    for n, k, warps in itertools.product(*grid_up[0]):
        t = (block_m, (n, k, warps), shipped[2])
        err = rel(up(t)[valid], h_ref[valid])
        s = timer(lambda: up(t))
        ups.append({"block_n": n, "block_k": k, "warps": warps, "us": s * 1e6, "pct_hbm": 100 * up_bytes / s / HBM,
                    "rel_err": err})
    for n, k, warps in itertools.product(*grid_down[0]):
        t = (block_m, shipped[1], (n, k, warps))
        err = rel(down(t)[valid], y_ref[valid])
        s = timer(lambda: down(t))
        downs.append({"block_n": n, "block_k": k, "warps": warps, "us": s * 1e6,
                      "pct_hbm": 100 * down_bytes / s / HBM, "rel_err": err})
    ship_up, ship_down = timer(lambda: up(shipped)), timer(lambda: down(shipped))
    return {"kind": kind, "M": m, "touched_experts": touched, "block_m": block_m,
            "shipped": {"up": shipped[1], "down": shipped[2], "up_us": ship_up * 1e6, "down_us": ship_down * 1e6,
                        "up_pct_hbm": 100 * up_bytes / ship_up / HBM, "down_pct_hbm": 100 * down_bytes / ship_down / HBM},
            "best_up": min(ups, key=lambda r: r["us"]), "best_down": min(downs, key=lambda r: r["us"]),
            "up": ups, "down": downs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/moe-packed-tiles.json")
    ap.add_argument("--kinds", default="fp8-128,fp8-32,bf16", help="comma list of fp8-128, fp8-32, bf16")
    ap.add_argument("--tokens", default="16,64,256")
    ap.add_argument("--smoke", action="store_true", help="one shape per kernel, M = 16, fp8-128 only")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    if not set(kinds) <= {"fp8-128", "fp8-32", "bf16"}:
        raise SystemExit(f"--kinds: {args.kinds!r}, expected a comma list of fp8-128, fp8-32, bf16")
    tokens = [int(m) for m in args.tokens.split(",")]
    if args.smoke:
        kinds, tokens = ["fp8-128"], [16]
    if not torch.cuda.is_available():
        print("bench/moe_packed_tiles.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.attn_batched import graph_timer

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for kind, m in itertools.product(kinds, tokens):
        r = sweep(kind, m, g, "cuda", graph_timer, args.smoke)
        rows.append(r)
        print(f"{kind} M={m}: shipped up {r['shipped']['up_us']:.1f} us ({r['shipped']['up_pct_hbm']:.0f} %), "
              f"down {r['shipped']['down_us']:.1f} us ({r['shipped']['down_pct_hbm']:.0f} %); best up {r['best_up']}; "
              f"best down {r['best_down']}", flush=True)
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm_bytes_per_s": HBM,
                  "layer": {"dim": DIM, "inter": INTER, "experts": EXPERTS, "top_k": TOP_K},
                  "timing": "graph_timer (CUDA-graph replays, L2 flushed)", "smoke": args.smoke}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"conditions": conditions, "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
