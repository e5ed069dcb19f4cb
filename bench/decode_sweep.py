"""Launch shapes of two decode-step kernels at 1 and 8 tokens, timed as CUDA-graph replays (as the
graph-captured step runs them): the mHC statistics pass and the inverse-RoPE + grouped `wo_a`.

    PYTHONPATH=. python bench/decode_sweep.py --out $OUT/decode-sweep-h200.json     # one H200, ~1 min

At one token the v4-mini step (bench/graph_decode.py --profile) spent 10 µs per mHC statistics call
(24 per step) and 18 µs per `wo_a` call (12) on weights of 0.8 MB and 17 MB: latency, not bandwidth.
* `mhc_stats`: `_launch_stats` alone (unfused pre and the fused post+pre), BLOCK_D x warps; `rel_err`
  of the reduced statistics against the default launch.
* `wo_a`: `launch_grouped_wo_a` over head splits x BLOCK_N; `rel_err` against the reference.
Shapes: v4-mini (hidden 2048, 32 heads, G 4, R 512) and V4-Flash (4096, 64, G 8, R 1024), bf16,
4 mHC streams. `us` from `bench.attn_batched.graph_timer` (L2 flushed, launch overhead removed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.attn_batched import HBM_BYTES_PER_S, graph_timer  # noqa: E402
from dspark.kernels import grouped_wo_a, mhc  # noqa: E402

LAYERS = {"v4-mini": dict(hidden=2048, heads=32, groups=4, rank=512),
          "v4-flash": dict(hidden=4096, heads=64, groups=8, rank=1024)}
HC, TOKENS = 4, (1, 8)
MHC_VARIANTS = [(16, d, w) for d in (16, 32, 64, 128) for w in (2, 4, 8)]
WO_A_VARIANTS = [(s, n) for s in (1, 2, 4, 8) for n in (16, 32)]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def mhc_rows(device, g, layers=tuple(LAYERS), tokens=TOKENS, variants=MHC_VARIANTS) -> list[dict]:
    rows = []
    for name in layers:
        shape = LAYERS[name]
        dim, n_mix = shape["hidden"], 2 * HC + HC * HC
        fn = torch.randn(n_mix, HC * dim, generator=g, device=device) * 0.01
        for n_tok in tokens:
            x = torch.randn(n_tok, HC, dim, generator=g, device=device).bfloat16()
            f = torch.randn(n_tok, dim, generator=g, device=device).bfloat16()
            post = torch.rand(n_tok, HC, generator=g, device=device)
            comb = torch.rand(n_tok, HC, HC, generator=g, device=device)
            for fused in (False, True):
                extra = (f, post, comb, torch.empty_like(x)) if fused else None
                base_d, base_sq = (p.sum(0) for p in mhc._launch_stats(x, fn, HC, dim, fused=extra))
                for tiles in variants:
                    try:
                        d, sq = (p.sum(0) for p in mhc._launch_stats(x, fn, HC, dim, fused=extra, tiles=tiles))
                        err = max(rel(d, base_d), rel(sq, base_sq))
                        seconds = graph_timer(lambda: mhc._launch_stats(x, fn, HC, dim, fused=extra, tiles=tiles))
                    except Exception as exc:  # a shape the compiler rejects: record, go on
                        rows.append(dict(case="mhc_stats", layer=name, tokens=n_tok, fused=fused, tiles=tiles,
                                         error=repr(exc)[:300]))
                        continue
                    n_bytes = fn.numel() * 4 + x.numel() * 2 * (3 if fused else 1)
                    rows.append(dict(case="mhc_stats", layer=name, tokens=n_tok, fused=fused, tiles=tiles,
                                     default=tiles == mhc._stats_tiles(n_tok, fused), us=seconds * 1e6,
                                     pct_hbm=100 * n_bytes / seconds / HBM_BYTES_PER_S, rel_err=err))
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def wo_a_rows(device, g) -> list[dict]:
    rows = []
    for name, shape in LAYERS.items():
        heads, groups, rank = shape["heads"], shape["groups"], shape["rank"]
        width = heads * 512 // groups
        weight = (torch.randn(groups * rank, width, generator=g, device=device) * width ** -0.5).bfloat16()
        for n_tok in TOKENS:
            out = torch.randn(n_tok, heads, 512, generator=g, device=device).bfloat16()
            angles = torch.rand(n_tok, 32, generator=g, device=device) * 100
            cos, sin = angles.cos(), angles.sin()
            ref = grouped_wo_a.grouped_wo_a_ref(out, cos, sin, weight)
            default = grouped_wo_a.default_tiles(n_tok, groups, rank, heads // groups, 512, 64, out.dtype)
            for splits, block_n in WO_A_VARIANTS:
                tiles = default._replace(splits=splits, block_n=block_n)
                try:
                    err = rel(grouped_wo_a.launch_grouped_wo_a(out, cos, sin, weight, tiles), ref)
                    seconds = graph_timer(lambda: grouped_wo_a.launch_grouped_wo_a(out, cos, sin, weight, tiles))
                except Exception as exc:
                    rows.append(dict(case="wo_a", layer=name, tokens=n_tok, tiles=tiles._asdict(),
                                     error=repr(exc)[:300]))
                    continue
                n_bytes = weight.numel() * 2 + out.numel() * 2 + n_tok * groups * rank * 2
                rows.append(dict(case="wo_a", layer=name, tokens=n_tok, tiles=tiles._asdict(), default=tiles == default,
                                 us=seconds * 1e6, pct_hbm=100 * n_bytes / seconds / HBM_BYTES_PER_S, rel_err=err))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/decode-sweep.json")
    p.add_argument("--layers", default=",".join(LAYERS), help=f"comma list of {tuple(LAYERS)}")
    p.add_argument("--mhc-tokens", default=None,
                   help="comma list of token counts for the mHC statistics sweep (default 1,8); with it the "
                        "sweep also tries 32- and 64-token tiles (verify blocks and many requests) and skips wo_a")
    args = p.parse_args(argv)
    layers = tuple(args.layers.split(","))
    if not set(layers) <= set(LAYERS):
        raise ValueError(f"--layers {args.layers!r}: each must be one of {tuple(LAYERS)}")
    if not torch.cuda.is_available():
        print("bench/decode_sweep.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    cond = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    if args.mhc_tokens:
        tokens = tuple(int(n) for n in args.mhc_tokens.split(","))
        variants = [(t, d, w) for t in (16, 32, 64) for d in (32, 64, 128) for w in (4, 8)]
        rows = mhc_rows(device, g, layers, tokens, variants)
    else:
        rows = mhc_rows(device, g, layers) + wo_a_rows(device, g)
    for case in ("mhc_stats", "wo_a"):  # the fastest variant per shape, beside the default
        groups = {}
        for r in rows:
            if r["case"] == case and "us" in r:
                groups.setdefault((r["layer"], r["tokens"], r.get("fused")), []).append(r)
        for key, rs in groups.items():
            best, default = min(rs, key=lambda r: r["us"]), next((r for r in rs if r["default"]), None)
            print(case, key, "best", best["tiles"], f"{best['us']:.1f} us", "default",
                  f"{default['us']:.1f} us" if default else "-", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"conditions": cond, "results": rows}, indent=1))
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
