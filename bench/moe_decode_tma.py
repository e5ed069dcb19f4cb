"""The decode MoE's gate/up launch through TMA (`dspark.kernels.moe_decode_tma`) against the GEMV kernel.

    python bench/moe_decode_tma.py --out $OUT/moe-decode-tma.json              # the up kernel alone, ~3 min
    python bench/moe_decode_tma.py --ab --out $OUT/moe-decode-tma-ab.json      # the whole op, ~2 min
    python bench/moe_decode_tma.py --down --out $OUT/moe-decode-tma-down.json  # the TMA down kernel, ~5 min
    python bench/moe_decode_tma.py --fused --out $OUT/moe-decode-fused.json    # the experts in one launch, ~5 min
    python bench/moe_decode_tma.py --early --out $OUT/moe-early.json           # the shared rows early, ~2 min

Default (the sweep): per layer (V4-Flash: D 4096, I 2048, top-6 of 256 plus the shared expert; v4-mini:
D 2048, I 512, top-6 of 64), weight kind (bf16, FP8 128×128, FP8 32×32) and token count (1, 8), the
gate/up launch alone: the GEMV kernel at its table's shape (`moe_decode.decode_tiles`) and the TMA
kernel over `TILES` × `STAGES` (or `--tiles` × `--stages`; `--sweep-early`: on its EARLY grid, as
`fused_moe` launches it at one token), outputs checked against the GEMV kernel's.

`--ab`: issue 6's whole op, router included (`bench/kernels.py`'s `fused_moe*` cases: the same layers,
inputs and byte counts), captured with `moe_decode.UP_TMA` as shipped and with None (the GEMV gate/up
kernel), the two timed in turn for `--rounds` rounds (medians).

`--down`: the TMA down kernel (`moe_decode_tma.tma_down`; `moe_decode.DOWN_TMA` entries) over `DOWN_SWEEP` × `SPLITS`
(expert slots per row block over that many programs) against the GEMV down kernel at its table's shape,
each alone on the same h; then the experts op (the shipped gate/up launch, then either down kernel)
at the best TMA shape against the shipped op, timed in turn for `--rounds` rounds; then issue 6's whole op
with that shape in the tables (`moe_decode.DOWN_TMA`) and without, in turn.

`--up-ab-from SWEEP_JSON`: issue 6's whole op with each row's best gate/up shape of an earlier sweep (as
`UP_TMA`, and as `FUSED`'s up half where one launch runs the experts) against the op as shipped, in turn.

`--early`: issue 6's whole op as shipped (`fused_moe` promises `x_ready`: the TMA gate/up launch starts the
shared experts' rows while the router's last launch runs) against the same op with the promise withheld,
in turn.

`--fused`: the experts in one launch (`moe_decode_tma.tma_fused`: gate/up items, then down items that wait
for their own row's h) at `UP_TMA` and each of `FUSED_DOWN` against the two launches, timed in turn; then
issue 6's whole op with the best of it in the tables (`moe_decode.FUSED`) and without, in turn. (The
fortieth session's run put it in `decode_experts`' place instead, before the table existed: the same op.)

Every time is a CUDA-graph replay with L2 flushed (`bench.attn_batched.graph_timer`, median of 50).
% HBM against 4.4 TB/s (issue 6's ceiling) and against this card's own measured copy bandwidth.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attn_batched import copy_bytes_per_s, graph_timer  # noqa: E402
from moe_decode_tiles import KINDS, LAYERS, op_bytes, routed_tokens, weights  # noqa: E402
from provenance import git_commit  # noqa: E402

HBM = 4.4e12
TILES = ((8, 256, 4), (16, 128, 4), (16, 256, 4), (16, 512, 8), (32, 128, 4))  # (rows, columns, warps)
STAGES = (3, 5, 7)
LIMIT = 10.0
SPLITS = (1, 2, 4, 7)
AB_OPS = {"bf16": "fused_moe", "fp8": "fused_moe_fp8_128", "fp8-32": "fused_moe_fp8_32"}
AB_LAYERS = {"v4-flash": "flash", "v4-mini": "mini"}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rate(n_bytes: float, seconds: float, copy_bps: float) -> dict:
    return {"us": seconds * 1e6, "pct_hbm": 100 * n_bytes / seconds / HBM,
            "copy_pct": 100 * n_bytes / seconds / copy_bps}


def parse_tiles(text: str) -> tuple:
    """`--tiles` "16x256x4,8x512x4" -> ((16, 256, 4), (8, 512, 4)): (rows, columns, warps) each; a ValueError
    naming an entry that is not three positive integers."""
    out = []
    for entry in text.split(","):
        parts = entry.strip().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--tiles entries are ROWSxCOLUMNSxWARPS, got {entry!r}")
        out.append(tuple(int(p) for p in parts))
    return tuple(out)


def up_sweep(name: str, block, m: int, g, copy_bps: float, tiles=TILES, stages=STAGES, early: bool = False) -> dict:
    """The gate/up launch alone: the GEMV kernel at the table's shape, then the TMA kernel's shapes
    (`tiles` × `stages`; `early`: its EARLY grid, shared rows first, as `fused_moe` launches it at one token)."""
    from dspark.kernels import moe_decode as md, moe_decode_tma as mt

    dim, inter, n_exp = LAYERS[name]
    w1, w2, w3, s1, s2, s3 = weights(dim, inter, n_exp, block, g)
    x, _, ids = routed_tokens(m, dim, n_exp, g)
    touched = int(torch.unique(ids).numel())
    up_bytes, _ = op_bytes(w1, w2, w3, s1, s2, s3, touched, m, dim)
    gemv = md.decode_tiles(m, block, dim)._replace(up_tma=None)
    h_ref, _ = md.decode_up(x, ids, w1, w3, s1, s3, LIMIT, gemv)
    row = {"layer": name, "fp8_block": block, "M": m, "touched_experts": touched, "up_bytes": up_bytes,
           "gemv_tiles": gemv._asdict(),
           "gemv": rate(up_bytes, graph_timer(lambda: md.decode_up(x, ids, w1, w3, s1, s3, LIMIT, gemv)), copy_bps)}
    tma = []
    for (n, k, warps), depth in itertools.product(tiles, stages):
        if block is not None and (block % n or k % block and block % k):
            continue
        t = mt.TmaTiles(n, k, warps, depth)
        h, _ = mt.tma_up(x, ids, w1, w3, s1, s3, LIMIT, t, early=early)
        seconds = graph_timer(lambda: mt.tma_up(x, ids, w1, w3, s1, s3, LIMIT, t, early=early))
        tma.append({**t._asdict(), **rate(up_bytes, seconds, copy_bps), "rel_err": rel_err(h, h_ref)})
    shipped = next((r for r in tma if tuple(r[f] for f in mt.TmaTiles._fields) == tuple(md.UP_TMA)), None)
    row.update(tma=tma, best=min(tma, key=lambda r: r["us"]), shipped=shipped, early_grid=early)
    return row


def down_sweep(name: str, block, m: int, g, copy_bps: float, rounds: int) -> dict:
    """The down launch alone: the GEMV kernel at the table's shape, then the TMA kernel's shapes and splits;
    then the experts op with the best TMA down against the shipped one, in turn."""
    from dspark.kernels import moe_decode as md, moe_decode_tma as mt

    dim, inter, n_exp = LAYERS[name]
    w1, w2, w3, s1, s2, s3 = weights(dim, inter, n_exp, block, g)
    x, wts, ids = routed_tokens(m, dim, n_exp, g)
    touched = int(torch.unique(ids).numel())
    up_bytes, down_bytes = op_bytes(w1, w2, w3, s1, s2, s3, touched, m, dim)
    # the GEMV down kernel at the table's shape (`DOWN_TMA`'s entries keep the tables' unsplit down launch)
    shipped = md.decode_tiles(m, block, dim)._replace(down_tma=None, fused=None)
    # tickets for the narrowest row blocks swept (8 rows), so every split shape can run on the same h
    h, args = md.decode_up(x, ids, w1, w3, s1, s3, LIMIT, shipped._replace(down_n=8, down_split=2))
    y_ref = md.decode_down(h, x, wts, ids, w2, s2, args, shipped._replace(down_n=8, down_split=2))
    gemv_args = md.decode_up(x, ids, w1, w3, s1, s3, LIMIT, shipped)[1]
    row = {"layer": name, "fp8_block": block, "M": m, "touched_experts": touched, "down_bytes": down_bytes,
           "gemv_tiles": shipped._asdict(), "gemv": rate(down_bytes, graph_timer(
               lambda: md.decode_down(h, x, wts, ids, w2, s2, gemv_args, shipped)), copy_bps)}
    tma = []
    for t, split in itertools.product(mt.DOWN_SWEEP, SPLITS):
        if (block is not None and block % t.n) or split > ids.shape[1] + 1:
            continue
        y = mt.tma_down(h, x, wts, ids, w2, s2, args, t, split)
        seconds = graph_timer(lambda: mt.tma_down(h, x, wts, ids, w2, s2, args, t, split))
        tma.append({**t._asdict(), "split": split, **rate(down_bytes, seconds, copy_bps),
                    "rel_err": rel_err(y, y_ref)})
    best = min(tma, key=lambda r: r["us"])
    best_tiles, best_split = mt.TmaTiles(*(best[f] for f in mt.TmaTiles._fields)), best["split"]

    def tma_op():
        h_, a_ = md.decode_up(x, ids, w1, w3, s1, s3, LIMIT, shipped._replace(down_n=best_tiles.n,
                                                                              down_split=best_split))
        return mt.tma_down(h_, x, wts, ids, w2, s2, a_, best_tiles, best_split)

    ops = {"shipped": lambda: md.decode_experts(x, wts, ids, w1, w2, w3, s1, s2, s3, LIMIT, tiles=shipped),
           "tma_down": tma_op}  # "shipped": the table's gate/up launch, then the GEMV down kernel
    times = {label: [] for label in ops}
    for _ in range(rounds):
        for label, fn in ops.items():
            times[label].append(graph_timer(fn))
    med = {label: statistics.median(t) for label, t in times.items()}
    row.update(tma=tma, best=best, experts_rounds=times,
               experts={label: rate(up_bytes + down_bytes, sec, copy_bps) for label, sec in med.items()},
               experts_speedup=med["shipped"] / med["tma_down"], experts_rel_err=rel_err(tma_op(), y_ref))
    return row


def fused_sweep(name: str, kind: str, m: int, g, copy_bps: float, rounds: int, layers: dict) -> dict:
    """The experts in one launch (`moe_decode_tma.tma_fused` at `UP_TMA` and each of `FUSED_DOWN`) against the
    two launches (`decode_experts` without `fused`), timed in turn; then issue 6's whole op (router included)
    with the best of it in the tables (`moe_decode.FUSED`) and without, in turn."""
    from dspark.kernels import moe_decode as md, moe_decode_tma as mt

    dim, inter, n_exp = LAYERS[name]
    block = KINDS[kind]
    w1, w2, w3, s1, s2, s3 = weights(dim, inter, n_exp, block, g)
    x, wts, ids = routed_tokens(m, dim, n_exp, g)
    touched = int(torch.unique(ids).numel())
    n_bytes = sum(op_bytes(w1, w2, w3, s1, s2, s3, touched, m, dim))
    experts = (x, wts, ids, w1, w2, w3, s1, s2, s3, LIMIT)
    two = md.decode_tiles(m, block, dim)._replace(fused=None)
    y_ref = md.decode_experts(*experts, tiles=two)
    ops = {"shipped": lambda: md.decode_experts(*experts, tiles=two)}  # the two launches
    for t in mt.FUSED_DOWN:
        ops[f"fused_{t.n}x{t.k}_w{t.warps}_s{t.stages}"] = lambda t=t: mt.tma_fused(*experts, md.UP_TMA, t)
    times = {label: [] for label in ops}
    for _ in range(rounds):
        for label, fn in ops.items():
            times[label].append(graph_timer(fn))
    med = {label: statistics.median(t) for label, t in times.items()}
    best = min((label for label in ops if label != "shipped"), key=med.get)
    best_tiles = mt.FUSED_DOWN[list(ops).index(best) - 1]
    key = md.table_key(m, block, dim)
    op = op_ab(name, kind, m, layers, copy_bps, rounds, {
        "fused": lambda: md.FUSED.update({key: (md.UP_TMA, best_tiles)}),
        "shipped": lambda: md.FUSED.pop(key, None)})
    return {"layer": name, "kind": kind, "M": m, "touched_experts": touched, "bytes": n_bytes, "rounds": times,
            "experts": {label: rate(n_bytes, sec, copy_bps) for label, sec in med.items()}, "best": best,
            "speedup": med["shipped"] / med[best], "op_ab": op,
            "rel_err": {label: rel_err(fn(), y_ref) for label, fn in ops.items()}}


def op_ab(layer_name: str, kind: str, m: int, layers: dict, copy_bps: float, rounds: int, sides: dict) -> dict:
    """Issue 6's whole op (router included) captured with each of `sides` (label -> a function that sets the
    decode tables for it; the first is the new side, the second the old, any more are timed too), timed in
    turn; the tables restored."""
    import kernels as kb

    from dspark.kernels import moe, moe_decode as md, moe_route_decode as mr

    shape = kb.CONFIGS[AB_LAYERS[layer_name]]
    if shape.name not in layers:
        layers[shape.name] = kb.build_layer(shape, "cuda")
    fused, ref, n_bytes, _ = kb.moe_case(AB_OPS[kind], shape, layers[shape.name], m, "cuda")
    saved_up, saved_down, saved_fused, saved_experts = md.UP_TMA, dict(md.DOWN_TMA), dict(md.FUSED), md.decode_experts
    saved_release, saved_counters = mr.RELEASE_FIRST, moe.experts_counters
    times, outputs = {label: [] for label in sides}, {}
    try:
        for _ in range(rounds):
            for label, put in sides.items():
                put()
                outputs[label] = fused()
                times[label].append(graph_timer(fused))
    finally:
        md.UP_TMA, md.decode_experts, mr.RELEASE_FIRST = saved_up, saved_experts, saved_release
        moe.experts_counters = saved_counters
        md.DOWN_TMA.clear()
        md.DOWN_TMA.update(saved_down)
        md.FUSED.clear()
        md.FUSED.update(saved_fused)
    med = {label: statistics.median(t) for label, t in times.items()}
    new, old = list(sides)[:2]
    return {"layer": layer_name, "op": AB_OPS[kind], "M": m, "bytes": n_bytes, "rounds": times,
            **{label: rate(n_bytes, med[label], copy_bps) for label in sides}, "speedup": med[old] / med[new],
            **{f"rel_err_{label}": rel_err(out, ref()) for label, out in outputs.items()}}


def up_sides() -> dict:
    """`--ab`'s sides: the gate/up launch through TMA as shipped (`UP_TMA`), and the GEMV kernel."""
    from dspark.kernels import moe_decode as md

    shipped = md.UP_TMA

    def put(up):
        return lambda: setattr(md, "UP_TMA", up)

    return {"tma": put(shipped), "gemv": put(None)}


def down_sides(key: tuple, tiles, split: int) -> dict:
    """The down launch through TMA at (tiles, split) for table key `key`, and without it (the GEMV kernel)."""
    from dspark.kernels import moe_decode as md

    return {"tma_down": lambda: md.DOWN_TMA.update({key: (tiles, split)}),
            "gemv_down": lambda: md.DOWN_TMA.pop(key, None)}


def up_tile_sides(key: tuple, tiles) -> dict:
    """The gate/up launch at `tiles` (as `UP_TMA`, and as the up half of `FUSED[key]` where one launch runs the
    experts), and as shipped."""
    from dspark.kernels import moe_decode as md

    shipped, fused = md.UP_TMA, md.FUSED.get(key)

    def put(up, one):
        def side():
            md.UP_TMA = up
            if fused is not None:
                md.FUSED[key] = one
        return side

    return {"candidate": put(tiles, fused and (tiles, fused[1])), "shipped": put(shipped, fused)}


def sweep_bests(path: str) -> list[tuple[str, str, int, object]]:
    """(layer, kind, tokens, best TmaTiles) of each row of an up sweep's JSON (this script's default mode)."""
    from dspark.kernels import moe_decode_tma as mt

    kinds = {block: kind for kind, block in KINDS.items()}
    return [(r["layer"], kinds[r["fp8_block"]], r["M"], mt.TmaTiles(*(r["best"][f] for f in mt.TmaTiles._fields)))
            for r in json.loads(Path(path).read_text())["results"]]


def early_sides() -> dict:
    """`--early`'s sides: `fused_moe` as shipped (its gate/up launch, or its one launch where `FUSED` has one,
    starts the shared rows while the router runs: `x_ready`, the select kernel releasing it before its wait,
    `RELEASE_FIRST`; the one launch's counters zeroed before the router); with none of these (every gate/up
    program waits for the router, as before, and the one launch zeroes its counters after the router);
    "early_wait": x_ready, but the select kernel waits for the logits before it releases the gate/up launch;
    "early_two": as shipped without the `FUSED` entries (where one launch runs the experts, the two launches
    with the early shared rows instead)."""
    from dspark.kernels import moe, moe_decode as md, moe_route_decode as mr

    shipped, release, fused, counters = md.decode_experts, mr.RELEASE_FIRST, dict(md.FUSED), moe.experts_counters

    def late(*args, x_ready=False, counters=None, **kw):
        return shipped(*args, **kw)

    def put(experts, release_first, one_launch=True):
        def side():
            md.decode_experts, mr.RELEASE_FIRST = experts, release_first
            moe.experts_counters = counters if experts is shipped else lambda *a: None
            md.FUSED.clear()
            md.FUSED.update(fused if one_launch else {})
        return side

    return {"early": put(shipped, release), "late": put(late, False), "early_wait": put(shipped, False),
            "early_two": put(shipped, release, one_launch=False)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/moe-decode-tma.json")
    ap.add_argument("--layers", default="v4-flash,v4-mini")
    ap.add_argument("--kinds", default="fp8,fp8-32,bf16")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--ab", action="store_true", help="the whole op with UP_TMA as shipped and None, in turn")
    ap.add_argument("--down", action="store_true", help="the TMA down kernel's shapes, then the experts op with it")
    ap.add_argument("--fused", action="store_true", help="the experts in one launch, then the op with it")
    ap.add_argument("--early", action="store_true", help="the whole op with the shared rows started early and not")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiles", type=parse_tiles, default=TILES, help="the sweep's ROWSxCOLUMNSxWARPS list")
    ap.add_argument("--stages", type=lambda t: tuple(int(v) for v in t.split(",")), default=STAGES,
                    help="the sweep's pipeline depths, e.g. 3,5")
    ap.add_argument("--sweep-early", action="store_true", help="the sweep on the EARLY grid (shared rows first)")
    ap.add_argument("--early-max-tokens", type=int, default=None,
                    help="--early: start the shared rows early up to this many tokens (default: "
                         "moe_decode.EARLY_MAX_TOKENS as shipped)")
    ap.add_argument("--up-ab-from", metavar="SWEEP_JSON",
                    help="the whole op with each row's best gate/up tiles of that sweep and as shipped, in turn")
    args = ap.parse_args(argv)
    from dspark.kernels import moe_decode, moe_decode_tma as mt

    if args.early_max_tokens is not None:
        moe_decode.EARLY_MAX_TOKENS = args.early_max_tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    copy_bps = copy_bytes_per_s(torch.device("cuda"))
    conditions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit(),
                  "hbm_bytes_per_s": HBM, "copy_bytes_per_s": copy_bps, "up_tma": moe_decode.UP_TMA._asdict(),
                  "mode": "up_ab" if args.up_ab_from else "ab" if args.ab else "down" if args.down else
                  "fused" if args.fused else "early" if args.early else "sweep",
                  "fused_down": mt.FUSED_DOWN, "splits": SPLITS, "tiles": args.tiles, "stages": args.stages,
                  "sweep_early": args.sweep_early, "early_max_tokens": moe_decode.EARLY_MAX_TOKENS,
                  "rounds": args.rounds,
                  "timing": "graph_timer (CUDA-graph replays after its default L2 flush, median of 50)"}
    rows, layers = [], {}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.up_ab_from:
        for name, kind, m, tiles in sweep_bests(args.up_ab_from):
            key = moe_decode.table_key(m, KINDS[kind], LAYERS[name][0])
            r = {**op_ab(name, kind, m, layers, copy_bps, args.rounds, up_tile_sides(key, tiles)),
                 "tiles": tiles._asdict()}
            new = r["candidate"]
            print(f"{name} {kind} M={m}: up {tuple(tiles)} op {r['shipped']['us']:.1f} -> {new['us']:.1f} us "
                  f"({r['speedup']:.3f}x, {new['pct_hbm']:.1f} %); err {r['rel_err_candidate']:.1e}", flush=True)
            rows.append(r)
            Path(args.out).write_text(json.dumps({"conditions": conditions, "results": rows}, indent=1) + "\n")
        return 0
    for name, kind, m in itertools.product(args.layers.split(","), args.kinds.split(","),
                                           [int(t) for t in args.tokens.split(",")]):
        if args.early:
            r = op_ab(name, kind, m, layers, copy_bps, args.rounds, early_sides())
            print(f"{name} {r['op']} M={m}: late {r['late']['us']:.1f} us early {r['early']['us']:.1f} us "
                  f"({r['early']['pct_hbm']:.1f} %) {r['speedup']:.3f}x, early_wait {r['early_wait']['us']:.1f} us, "
                  f"early_two {r['early_two']['us']:.1f} us; "
                  f"err {r['rel_err_early']:.1e} / {r['rel_err_late']:.1e}", flush=True)
        elif args.ab:
            r = op_ab(name, kind, m, layers, copy_bps, args.rounds, up_sides())
            print(f"{name} {r['op']} M={m}: gemv {r['gemv']['us']:.1f} us ({r['gemv']['pct_hbm']:.1f} %) tma "
                  f"{r['tma']['us']:.1f} us ({r['tma']['pct_hbm']:.1f} %) {r['speedup']:.3f}x; err "
                  f"{r['rel_err_tma']:.1e} / {r['rel_err_gemv']:.1e}", flush=True)
        elif args.fused:
            r = fused_sweep(name, kind, m, g, copy_bps, args.rounds, layers)
            op = r["op_ab"]
            print(f"{name} {kind} M={m}: experts shipped {r['experts']['shipped']['us']:.1f} us, fused best "
                  f"{r['experts'][r['best']]['us']:.1f} ({r['best']}, {r['speedup']:.3f}x, err "
                  f"{r['rel_err'][r['best']]:.1e}); op {op['shipped']['us']:.1f} -> {op['fused']['us']:.1f} us "
                  f"({op['speedup']:.3f}x, {op['fused']['pct_hbm']:.1f} %)", flush=True)
        elif args.down:
            r = down_sweep(name, KINDS[kind], m, g, copy_bps, args.rounds)
            best = mt.TmaTiles(*(r["best"][f] for f in mt.TmaTiles._fields))
            key = moe_decode.table_key(m, KINDS[kind], LAYERS[name][0])
            r["op_ab"] = op = op_ab(name, kind, m, layers, copy_bps, args.rounds,
                                    down_sides(key, best, r["best"]["split"]))
            print(f"{name} {kind} M={m}: down gemv {r['gemv']['us']:.1f} us, tma best {r['best']['us']:.1f} at "
                  f"{tuple(r['best'][f] for f in ('n', 'k', 'warps', 'stages', 'split'))}; experts shipped "
                  f"{r['experts']['shipped']['us']:.1f} us, with the TMA down {r['experts']['tma_down']['us']:.1f} "
                  f"({r['experts_speedup']:.3f}x); op {op['gemv_down']['us']:.1f} -> {op['tma_down']['us']:.1f} us "
                  f"({op['speedup']:.3f}x, {op['tma_down']['pct_hbm']:.1f} %)", flush=True)
        else:
            r = up_sweep(name, KINDS[kind], m, g, copy_bps, args.tiles, args.stages, args.sweep_early)
            print(f"{name} {kind} M={m}: up gemv {r['gemv']['us']:.1f} us, tma shipped "
                  f"{r['shipped'] and round(r['shipped']['us'], 1)} best {r['best']['us']:.1f} at "
                  f"{tuple(r['best'][f] for f in ('n', 'k', 'warps', 'stages'))}", flush=True)
        rows.append(r)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"conditions": conditions, "results": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
