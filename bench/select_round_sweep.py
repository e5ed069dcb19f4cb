"""Launch shapes of two latency-bound V4.1 step kernels, swept at the v41-mini step's shapes.

    PYTHONPATH=. python bench/select_round_sweep.py --former-round .ab/cache_round_old.py   # one GPU, < 2 min
    PYTHONPATH=. python bench/select_round_sweep.py --smoke --out /tmp/sweep.json          # CPU interpreter

The H100 graph profile of the v41-mini one-request step (`v41-profile-h100-s27.json`, PDL off) spent
259 µs in 5 `_select_kernel` launches (top-512 of 2 080 / 4 160 entries: ratio-2 and ratio-1 index
sources at 4K) and 168 µs in 23 `_round_kernel` launches of a few hundred values each:

* `select_topk`, one program per row: warps per program 4 / 8 / 16 / 32 with 4 bits of θ per
  counting pass (`launch_select_topk(num_warps=)`; "shipped" = `select_warps`), and 8 bits at 16 /
  32 warps. The passes are serial block reductions of one program; more warps hide their latency.
  "former": `--former-select`, indexer.py before the row's register tail (one tile of the row's
  next power of two), at its shipped warps.
* `cache_round`, blocks per program 1 .. 64 (`launch_cache_round(rows=)`; "shipped" =
  `round_rows`), and "former": the kernel before its per-value divisions became exact reciprocal
  products, loaded from `--former-round` (that file at an earlier commit), at its 64 blocks.

Each cell is a CUDA graph of `--calls` calls, median replay / calls (`latency_kernels.time_call`),
with PDL off and on; every variant's output is compared with the reference bit for bit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.latency_kernels import bench_device, conditions, time_call  # noqa: E402

# (requests, entries, top-k); (name, fmt, shape, window rows written into a ring)
FULL = dict(select=((1, 1024, 512), (1, 1040, 512), (1, 2080, 512), (1, 4160, 512), (8, 4160, 512), (1, 8192, 512),
                    (1, 8208, 512)),
            round=(("window", "fp8_ue8m0", (1, 512), True), ("window8", "fp8_ue8m0", (8, 512), True),
                   ("index_q", "fp4_ue8m0", (1, 32, 128), False), ("index_q8", "fp4_ue8m0", (8, 32, 128), False),
                   ("index_key", "fp4_ue8m0", (1, 128), False), ("entry", "fp4_e4m3", (1, 512), False)))
SMOKE = dict(select=((1, 40, 16), (2, 70, 9)),
             round=(("window", "fp8_ue8m0", (2, 64), True), ("index_q", "fp4_ue8m0", (1, 4, 32), False)))
SELECT_VARIANTS = {"w4": (4, 4), "w8": (4, 8), "w16": (4, 16), "w32": (4, 32), "r8w16": (8, 16), "r8w32": (8, 32)}
ROUND_ROWS = (1, 2, 4, 8, 16, 64)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(os.environ.get("OUT", "bench/results")) / "select-round-sweep.json"))
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter: checks the script")
    p.add_argument("--former-round", default=None, help="cache_round.py before the reciprocal products")
    p.add_argument("--former-select", default=None, help="indexer.py before the register tail")
    p.add_argument("--select-only", action="store_true", help="the selection cells alone")
    p.add_argument("--calls", type=int, default=24, help="calls of the op per captured graph")
    p.add_argument("--reps", type=int, default=30, help="graph replays timed (median)")
    return p.parse_args(argv)


def select_cells(cfg: dict, device, g, former_path: str | None) -> list[tuple]:
    from dspark.kernels import indexer

    former = load_module(former_path, "indexer_former") if former_path else None
    cells = []
    for rows, n_keys, topk in cfg["select"]:
        scores = torch.randn(rows, n_keys, generator=g, device=device)
        variants = {"shipped": lambda s=scores, k=topk: indexer.select_topk(s, k)}
        variants.update({name: (lambda s=scores, k=topk, b=bits, w=warps: indexer.launch_select_topk(s, k, None, None, b, w))
                         for name, (bits, warps) in SELECT_VARIANTS.items()})
        if former is not None:
            variants["former"] = lambda s=scores, k=topk: former.select_topk(s, k)
        cells.append(("select_topk", f"S{rows}_T{n_keys}_k{topk}", variants, indexer.select_topk_ref(scores, topk)))
    return cells


def load_module(path: str, name: str):
    """A kernel module as an earlier commit had it (its own Triton kernels beside the shipped ones)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def round_cells(cfg: dict, device, g, former_path: str | None) -> list[tuple]:
    from dspark.kernels import cache_round as op

    former = load_module(former_path, "cache_round_former") if former_path else None
    cells = []
    for name, fmt, shape, into_ring in cfg["round"]:
        x = (torch.randn(shape, generator=g, device=device) * 3).to(torch.bfloat16)
        n = x.numel() // x.shape[-1]
        if into_ring:  # the window rows of a static step: written into their ring rows
            ring = torch.zeros(4 * n, x.shape[-1], dtype=x.dtype, device=device)
            rows = torch.randperm(4 * n, generator=g, device=device)[:n]
            kw = dict(out=ring, out_rows=rows)
            ref = op.cache_round_ref(x, fmt=fmt, out=ring.clone(), out_rows=rows).clone()
        else:
            kw = dict(out=None, out_rows=None)
            ref = op.cache_round_ref(x, fmt=fmt)
        variants = {"shipped": lambda x=x, fmt=fmt, kw=kw: op.cache_round(x, fmt=fmt, **kw)}
        variants.update({f"rows{r}": (lambda x=x, fmt=fmt, kw=kw, r=r: op.launch_cache_round(x, fmt, kw["out"], kw["out_rows"], r))
                         for r in ROUND_ROWS})
        if former is not None:
            variants["former"] = lambda x=x, fmt=fmt, kw=kw: former.cache_round(
                x, fmt=fmt, **({} if kw["out"] is None else kw))
        cells.append(("cache_round", f"{name}_{fmt}_{'x'.join(map(str, shape))}", variants, ref))
    return cells


def run(cells: list[tuple], device, pdl: bool, args) -> list[dict]:
    from dspark.kernels import triton_compat

    triton_compat.PDL = pdl
    rows = []
    for op, case, variants, ref in cells:
        row = {"op": op, "case": case, "pdl": pdl, "us": {}, "equal_ref": {}}
        for name, fn in variants.items():
            try:
                row["equal_ref"][name] = bool(torch.equal(fn().clone(), ref))
                row["us"][name] = time_call(fn, device, args.calls, args.reps)
            except Exception as e:  # one failing variant must not lose the others
                row.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
        if row["us"]:
            row["best"] = min(row["us"], key=row["us"].get)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bench_device(args.smoke, "bench/select_round_sweep.py")
    if device is None:
        return 2
    from dspark.kernels import triton_compat

    cfg = SMOKE if args.smoke else FULL
    cond = conditions(device, args)
    cond.update(former_round=args.former_round, former_select=args.former_select)
    print(json.dumps(cond), flush=True)
    g = torch.Generator(device=device).manual_seed(0)
    shipped_pdl, rows, start = triton_compat.PDL, [], time.time()
    with torch.inference_mode():
        cells = select_cells(cfg, device, g, args.former_select)
        if not args.select_only:
            cells += round_cells(cfg, device, g, args.former_round)
        try:
            for pdl in ((False,) if args.smoke else (False, True)):
                rows += run(cells, device, pdl, args)
        finally:
            triton_compat.PDL = shipped_pdl
    summary = [f"{r['op']:12s} {r['case']:28s} pdl={int(r['pdl'])} " + " ".join(f"{k} {v:.2f}" for k, v in r["us"].items())
               for r in rows]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"conditions": cond, "results": rows, "summary": summary}, indent=1) + "\n")
    print("\n".join(summary))
    print(f"wrote {out} ({len(rows)} rows, {time.time() - start:.0f} s)")
    bad = [r for r in rows if r.get("errors") or not all(r["equal_ref"].values())]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
