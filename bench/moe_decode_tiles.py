"""Launch-shape sweep of the decode MoE kernels (`dspark.kernels.moe_decode`) at M = 1 and 8 tokens.

    python bench/moe_decode_tiles.py --out $OUT/moe-decode-tiles.json      # one H200, ~1 min
    python bench/moe_decode_tiles.py --layers v4-mini --wide --graph --out $OUT/moe-decode-tiles-mini.json

For the V4-Flash layer (D 4096, I 2048, top-6 of 256 experts plus the shared expert) and v4-mini
(D 2048, I 512, top-6 of 64), bf16 and FP8 (128×128 blocks; `--kinds fp8-32`: V4.1's 32×32) weights, each kernel is timed alone over
every `DecodeTiles` candidate (output rows per program × reduction step × warps), then the whole
`decode_experts` with the uniform `DecodeTiles()` (`default`) and with the shipped per-size choice
`decode_tiles(M, block, D)` (`shipped`, picked from this script's runs), and with the best shape
of each kernel (`best`: the pair timed as one op in the same run, what a table entry from this run ships). Bytes are the weights the picked
experts must read (plus scales) and the activations; % HBM against 4.4 TB/s. Timing:
`triton.testing.do_bench` (L2 flushed), median. Every candidate's output is checked against the
uniform shape's (same fp32 reduction order per row only when block_k matches, so the check is a relative
error, reported). `--wide` adds 4-row programs and reduction steps up to the whole row (1024, 2048: a
v4-mini row is 2048 long, so one step loads it at once); `--graph` times each call as a CUDA-graph replay
with L2 flushed (`bench.attn_batched.graph_timer`: what it costs inside the captured decode step, without
the eager launch overhead that do_bench includes). `--fp8-steps` and `--rows` replace the FP8 reduction
steps and the rows per program swept (e.g. `--fp8-steps 256,512,1024,2048 --rows 4,8,16,32`, the
fourteenth session's whole-row steps), `--stages 1,2,3` adds the software-pipelined loops
(`DecodeTiles.stages`) to every candidate, `--defer 0,1` the column sums deferred to the end of
each row (`DecodeTiles.up_defer`, `down_defer`), `--splits 1,2,4,7` the down kernel's expert slots spread
over that many programs per row block (`DecodeTiles.down_split`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HBM = 4.4e12
LAYERS = {"v4-flash": (4096, 2048, 256), "v4-mini": (2048, 512, 64)}  # D, I (routed = shared), E
TOP_K = 6
UP_N, DOWN_N, BLOCK_K, WARPS = (8, 16, 32), (8, 16, 32), (128, 256, 512), (4, 8)
WIDE_N, WIDE_K = (4, 8, 16, 32), (128, 256, 512, 1024, 2048)


KINDS = {"bf16": None, "fp8": 128, "fp8-32": 32}  # weight kind -> FP8 scale block (None: bf16)


def weights(dim, inter, n_exp, block, g):
    from dspark.kernels.fp8 import FP8BlockWeight

    shapes = ((n_exp, inter, dim), (n_exp, dim, inter), (n_exp, inter, dim), (inter, dim), (dim, inter), (inter, dim))
    out = [torch.randn(*s, generator=g, device="cuda") * s[-1] ** -0.5 for s in shapes]
    return [FP8BlockWeight.quantize(w, block) if block else w.bfloat16() for w in out]


def routed_tokens(m: int, dim: int, n_exp: int, g):
    """x [m, D] bf16, routing weights [m, K] fp32 and ids [m, K] int32 (K = TOP_K distinct experts a token)."""
    x = torch.randn(m, dim, generator=g, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(n_exp, device="cuda")[:TOP_K] for _ in range(m)]).int()
    return x, torch.rand(m, TOP_K, generator=g, device="cuda") + 0.1, ids


def op_bytes(w1, w2, w3, s1, s2, s3, touched: float, m: int, dim: int) -> tuple[float, float]:
    """Bytes the up and the down kernel must read: `touched` experts of the routed weights (plus scales),
    the shared expert's, and the m bf16 activations each."""
    up = nbytes(w1, touched) + nbytes(w3, touched) + nbytes(s1, 1) + nbytes(s3, 1) + m * dim * 2
    return up, nbytes(w2, touched) + nbytes(s2, 1) + m * dim * 2


def nbytes(w, rows: int) -> int:
    """Bytes of `rows` experts of a stacked weight (or the whole of an unstacked one)."""
    parts = [w.data, w.scale] if hasattr(w, "scale") else [w]
    total = 0
    for t in parts:
        per = t[0].numel() * t.element_size() if t.dim() == 3 else t.numel() * t.element_size()
        total += per * rows if t.dim() == 3 else per
    return total


def timed(fn, graph: bool = False) -> float:
    if graph:
        from bench.attn_batched import graph_timer

        return graph_timer(fn)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40) * 1e-3


def sweep_layer(name, block, m, g, wide: bool = False, graph: bool = False, fp8_steps: tuple = (),
                rows: tuple = (), stages: tuple = (1,), defer: tuple = (False,), splits: tuple = (1,)) -> dict:
    """One layer, weight kind (`block`: FP8 scale block, None for bf16) and token count: every candidate
    of each kernel, then the whole op at the default, shipped and best-per-kernel shapes."""
    from triton.runtime.errors import OutOfResources

    from dspark.kernels import moe_decode as md

    dim, inter, n_exp = LAYERS[name]
    fp8 = block is not None
    w1, w2, w3, s1, s2, s3 = weights(dim, inter, n_exp, block, g)
    x, wts, ids = routed_tokens(m, dim, n_exp, g)
    touched = int(torch.unique(ids).numel())
    up_bytes, down_bytes = op_bytes(w1, w2, w3, s1, s2, s3, touched, m, dim)
    default = md.DecodeTiles()
    h_ref, args = md.decode_up(x, ids, w1, w3, s1, s3, 10.0, default)
    y_ref = md.decode_down(h_ref, x, wts, ids, w2, s2, args, default)
    ups, downs = [], []
    # FP8 steps: one 128-wide scale block, or with --wide whole blocks (`moe_decode._gemv_fp8`)
    block_ks = (fp8_steps or (WIDE_K[:3] if wide else (128,))) if fp8 else WIDE_K if wide else BLOCK_K
    up_ns, down_ns = (rows, rows) if rows else (WIDE_N, WIDE_N) if wide else (UP_N, DOWN_N)
    timed_ = lambda fn: timed(fn, graph)  # noqa: E731
    for n, k, warps, st, d in itertools.product(up_ns, [k for k in block_ks if k <= dim], WARPS, stages, defer):
        t = md.DecodeTiles(up_n=n, up_k=k, up_warps=warps, stages=st, up_defer=d)
        shape = {"up_n": n, "block_k": k, "num_warps": warps, "stages": st, "defer": d}
        try:
            h, _ = md.decode_up(x, ids, w1, w3, s1, s3, 10.0, t)
        except OutOfResources as e:  # a pipelined shape past the SM's shared memory: recorded, not timed
            ups.append({**shape, "skipped": str(e)})
            continue
        err = ((h - h_ref).norm() / h_ref.norm()).item()
        s = timed_(lambda: md.decode_up(x, ids, w1, w3, s1, s3, 10.0, t))
        ups.append({**shape, "us": s * 1e6, "pct_hbm": 100 * up_bytes / s / HBM, "rel_err": err})
    for n, k, warps, st, d, sp in itertools.product(down_ns, [k for k in block_ks if k <= inter], WARPS, stages,
                                                    defer, splits):
        if sp > 1 and st > 1:  # the split down kernel runs stages 1 only
            continue
        t = md.DecodeTiles(down_n=n, down_k=k, down_warps=warps, stages=st, down_defer=d, down_split=sp)
        shape = {"down_n": n, "block_k": k, "num_warps": warps, "stages": st, "defer": d, "split": sp}
        # the split kernel's ticket counters come with decode_up's args for its tiles (each call leaves them 0)
        args_t = md.decode_up(x, ids, w1, w3, s1, s3, 10.0, t)[1] if sp > 1 else args
        try:
            y = md.decode_down(h_ref, x, wts, ids, w2, s2, args_t, t)
        except OutOfResources as e:
            downs.append({**shape, "skipped": str(e)})
            continue
        err = ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
        s = timed_(lambda: md.decode_down(h_ref, x, wts, ids, w2, s2, args_t, t))
        downs.append({**shape, "us": s * 1e6, "pct_hbm": 100 * down_bytes / s / HBM, "rel_err": err})
    best_up = min((r for r in ups if "us" in r), key=lambda r: r["us"])
    best_down = min((r for r in downs if "us" in r), key=lambda r: r["us"])
    full_default = timed_(lambda: md.decode_experts(x, wts, ids, w1, w2, w3, s1, s2, s3, 10.0, default))
    shipped = md.decode_tiles(m, block, dim)
    full_shipped = timed_(lambda: md.decode_experts(x, wts, ids, w1, w2, w3, s1, s2, s3, 10.0, shipped))
    total = up_bytes + down_bytes
    # The whole op at the best shape of each kernel (one stage count: the up kernel's), timed in this run.
    best = md.DecodeTiles(up_n=best_up["up_n"], up_k=best_up["block_k"], up_warps=best_up["num_warps"],
                          down_n=best_down["down_n"], down_k=best_down["block_k"], down_warps=best_down["num_warps"],
                          stages=best_up["stages"], up_defer=best_up["defer"],
                          down_defer=best_down["defer"], down_split=best_down["split"])
    full_best = timed_(lambda: md.decode_experts(x, wts, ids, w1, w2, w3, s1, s2, s3, 10.0, best))
    return {"layer": name, "fp8": fp8, "fp8_block": block, "M": m, "touched_experts": touched, "up_bytes": up_bytes, "down_bytes": down_bytes,
            "default": {"tiles": default._asdict(), "us": full_default * 1e6, "pct_hbm": 100 * total / full_default / HBM},
            "shipped": {"tiles": shipped._asdict(), "us": full_shipped * 1e6, "pct_hbm": 100 * total / full_shipped / HBM},
            "best": {"tiles": best._asdict(), "us": full_best * 1e6, "pct_hbm": 100 * total / full_best / HBM},
            "best_up": best_up, "best_down": best_down,
            "best_pair_pct_hbm": 100 * total / ((best_up["us"] + best_down["us"]) * 1e-6) / HBM,
            "up": ups, "down": downs}


CHAIN_SETS = {"v4-flash": 2, "v4-mini": 12}  # weight sets per chain (v4-mini: its 12 layers; Flash's 2 fill 26 GB)
CHAIN_CALLS = 12  # op calls per captured chain, each with its own tokens and experts


def chain_seconds(calls, rounds: int) -> list[float]:
    """Seconds per call of `calls` (a list of thunks) captured as one CUDA graph, one median per round.
    The calls read different weight sets and experts in turn, as the decode step's layers do, so they
    stream their weights from HBM without an L2 flush between them."""
    from graph_timing import capture, replay_seconds

    graph = capture(lambda: [c() for c in calls])
    return [replay_seconds(graph, 20) / len(calls) for _ in range(rounds)]


def split_ab(name, block, m, g, splits: tuple, rounds: int = 3) -> dict:
    """The shipped shape (`decode_tiles`) against itself with the down kernel's expert slots split over
    `splits` programs (`DecodeTiles.down_split`) at its row block and at 2 and 4 times it (the split
    brings the programs back). Each variant is timed as a chain of CHAIN_CALLS calls over CHAIN_SETS
    weight sets (`chain_seconds`: the whole op, and the down kernel alone on the calls' h), the variants
    in turn for `rounds` rounds (median), every output checked against the shipped op's."""
    from triton.runtime.errors import OutOfResources

    from dspark.kernels import moe_decode as md

    dim, inter, n_exp = LAYERS[name]
    sets = [weights(dim, inter, n_exp, block, g) for _ in range(CHAIN_SETS[name])]
    calls = []
    for i in range(CHAIN_CALLS):
        calls.append((*routed_tokens(m, dim, n_exp, g), sets[i % len(sets)]))
    touched = sum(int(torch.unique(ids).numel()) for _, _, ids, _ in calls) / len(calls)
    up_bytes, down_bytes = op_bytes(*sets[0], touched, m, dim)
    total = up_bytes + down_bytes  # bytes of one call
    shipped = md.decode_tiles(m, block, dim)
    op = lambda t, c: md.decode_experts(c[0], c[1], c[2], *c[3], 10.0, tiles=t)  # noqa: E731
    want = [op(shipped, c) for c in calls]
    variants = [shipped._replace(down_n=n, down_split=sp) for n in
                sorted({shipped.down_n, 2 * shipped.down_n, 4 * shipped.down_n}) for sp in (1, *splits)]
    rows, timers = [], []
    for t in variants:
        shape = {"down_n": t.down_n, "split": t.down_split}
        try:
            got = [op(t, c) for c in calls]
        except OutOfResources as e:  # recorded, not timed
            rows.append({**shape, "skipped": str(e)})
            continue
        ups = [md.decode_up(c[0], c[2], c[3][0], c[3][2], c[3][3], c[3][5], 10.0, t) for c in calls]
        downs = [lambda t=t, c=c, u=u: md.decode_down(u[0], c[0], c[1], c[2], c[3][1], c[3][4], u[1], t)
                 for c, u in zip(calls, ups)]
        err = max(((y.float() - w.float()).norm() / w.float().norm()).item() for y, w in zip(got, want))
        rows.append({**shape, "rel_err": err, "op_s": [], "down_s": []})
        timers.append((rows[-1], [lambda t=t, c=c: op(t, c) for c in calls], downs))
    for _ in range(rounds):  # the variants in turn, so that clocks and neighbours drift over all alike
        for row, op_calls, down_calls in timers:
            row["op_s"] += chain_seconds(op_calls, 1)
            row["down_s"] += chain_seconds(down_calls, 1)
    for row, _, _ in timers:
        row["op_us"] = statistics.median(row["op_s"]) * 1e6
        row["down_us"] = statistics.median(row["down_s"]) * 1e6
        row["op_pct_hbm"] = 100 * total / (row["op_us"] * 1e-6) / HBM
        row["down_pct_hbm"] = 100 * down_bytes / (row["down_us"] * 1e-6) / HBM
        print(f"{name} fp8_block={block} M={m} down_n={row['down_n']} split={row['split']}: down "
              f"{row['down_us']:.1f} us, op {row['op_us']:.1f} us ({row['op_pct_hbm']:.0f} % HBM)", flush=True)
    plain = [r for r in rows if r["down_n"] == shipped.down_n and "op_us" in r]
    # the table's own shape where it is among the rows (--splits with its split), else its unsplit row
    base = next((r for r in plain if r["split"] == shipped.down_split), None) or \
        next(r for r in plain if r["split"] == 1)
    best = min((r for r in rows if "op_us" in r), key=lambda r: r["op_us"])
    return {"layer": name, "fp8_block": block, "M": m, "shipped": shipped._asdict(), "bytes_per_call": total,
            "chain": {"calls": CHAIN_CALLS, "weight_sets": len(sets), "rounds": rounds},
            "shipped_op_us": base["op_us"], "best": best, "speedup": base["op_us"] / best["op_us"], "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/moe-decode-tiles.json")
    ap.add_argument("--layers", default=",".join(LAYERS), help=f"comma list of {tuple(LAYERS)}")
    ap.add_argument("--wide", action="store_true", help="also 4-row programs and whole-row reduction steps")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (L2 flushed), not do_bench")
    ap.add_argument("--kinds", default="bf16,fp8", help="weight kinds: comma list of bf16, fp8 (128x128), fp8-32")
    ap.add_argument("--tokens", default="1,8", help="comma list of token counts")
    ap.add_argument("--fp8-steps", default="", help="FP8 reduction steps to sweep (default 128, or 128-512 with --wide)")
    ap.add_argument("--rows", default="", help="output rows per program to sweep (default by --wide)")
    ap.add_argument("--stages", default="1", help="software-pipeline depths to sweep (DecodeTiles.stages)")
    ap.add_argument("--defer", default="0", help="column sums to sweep: comma list of 0 (every K step), 1 (once "
                    "per row, DecodeTiles.up_defer / down_defer)")
    ap.add_argument("--splits", default="1", help="down kernel expert splits to sweep (DecodeTiles.down_split: "
                    "the shared + K routed slots over this many programs per row block)")
    ap.add_argument("--split-ab", action="store_true", help="instead of the sweep: the shipped shapes against "
                    "themselves with --splits programs per down row block, timed as chains of calls over "
                    "several weight sets in interleaved rounds (`split_ab`; --graph does not apply)")
    args = ap.parse_args()
    splits = tuple(int(n) for n in args.splits.split(",") if n)
    fp8_steps = tuple(int(k) for k in args.fp8_steps.split(",") if k)
    rows_ = tuple(int(n) for n in args.rows.split(",") if n)
    stages = tuple(int(n) for n in args.stages.split(",") if n)
    defer = tuple(bool(int(d)) for d in args.defer.split(",") if d)
    layers = args.layers.split(",")
    if not set(layers) <= set(LAYERS):
        raise SystemExit(f"--layers: unknown {sorted(set(layers) - set(LAYERS))}; known {tuple(LAYERS)}")
    if not set(args.kinds.split(",")) <= set(KINDS):
        raise SystemExit(f"--kinds: {args.kinds!r}, expected a comma list of {', '.join(KINDS)}")
    kinds = [KINDS[k] for k in args.kinds.split(",")]
    tokens = [int(m) for m in args.tokens.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm_bytes_per_s": HBM,
                  "wide": args.wide, "fp8_steps": fp8_steps, "rows": rows_, "stages": stages, "defer": defer, "splits": splits, "split_ab": args.split_ab, "timing": "graph_timer" if args.graph else "triton.testing.do_bench"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.split_ab:
        split_ab_main(args.out, conditions, layers, kinds, tokens, g, tuple(sp for sp in splits if sp > 1))
        return
    rows = []
    for name, block, m in itertools.product(layers, kinds, tokens):
        row = sweep_layer(name, block, m, g, args.wide, args.graph, fp8_steps, rows_, stages, defer, splits)
        rows.append(row)
        print(f"{name} fp8_block={block} M={m}: default {row['default']['us']:.1f} us ({row['default']['pct_hbm']:.0f} % HBM); "
              f"shipped {row['shipped']['us']:.1f} us ({row['shipped']['pct_hbm']:.0f} % HBM); "
              f"best up {row['best_up']} down {row['best_down']}; best pair {row['best_pair_pct_hbm']:.0f} % HBM; whole op at the best shapes {row['best']['us']:.1f} us "
              f"({row['best']['pct_hbm']:.0f} % HBM) {tuple(row['best']['tiles'].values())}", flush=True)
    Path(args.out).write_text(json.dumps({"conditions": conditions, "results": rows}, indent=1) + "\n")


def split_ab_main(out, conditions, layers, kinds, tokens, g, splits) -> None:
    """`--split-ab`: `split_ab` per layer, weight kind and token count, the JSON rewritten after each."""
    rows = []
    for name, block, m in itertools.product(layers, kinds, tokens):
        r = split_ab(name, block, m, g, splits)
        rows.append(r)
        print(f"{r['layer']} fp8_block={r['fp8_block']} M={r['M']}: shipped {r['shipped_op_us']:.1f} us, best "
              f"{r['best']['op_us']:.1f} us at down_n={r['best']['down_n']} split={r['best']['split']} "
              f"({r['speedup']:.3f}x, {r['best']['op_pct_hbm']:.0f} % HBM)", flush=True)
        # written after every layer: a run cut by its time limit keeps what it measured
        Path(out).write_text(json.dumps({"conditions": {**conditions, "timing": "chain_seconds"}, "results": rows},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
