"""Decode attention at 32K context: the shipped `sparse_attention` against `attention_wide` launch shapes.

    PYTHONPATH=. python bench/attn_variants.py --out $OUT/attn-variants.json    # one H200, ~3-4 min
    PYTHONPATH=. python bench/attn_variants.py --smoke --out /tmp/attn-var.json # CPU interpreter: checks the script

Cases: B ∈ {1, 8, 64, 256, 512} requests, one query each at the end of its own 32K-token context, in
one launch over one pool (`bench/attn_batched.py::decode_inputs`): v4-mini CSA (32 heads, window 128
+ top-512 = 640 keys), V4-Flash CSA (64 heads, 640 keys), V4-Flash HCA (64 heads, window + 256
entries = 384 keys); head_dim 512, bf16.

Each `VARIANTS` entry is a `Tiles` launch shape (`current` = `sparse_attention` as shipped). Times are
CUDA-graph replays with L2 flushed (`attn_batched.graph_timer`: a captured 256 MB read before the
op, a write before the forty-second session; the flush alone subtracted, median of 50 replays). `pct_hbm` counts the key rows read once + q +
out + index over the 4.4 TB/s H200 copy bandwidth, as `attn_batched.py` does. Every variant is checked
against the reference on the first 8 queries (`rel_err_ref`) and against `current` on every query
(`rel_err_current`), its output memory poisoned with NaN first; a variant that fails to compile or
launch (shared memory) is recorded with its error. The last lines print a µs table and, per case, the
fastest variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from any directory
    sys.path.insert(0, str(REPO))

from bench.attn_batched import (HBM_BYTES_PER_S, HEAD_DIM, LAYERS, conditions, cpu_timer,  # noqa: E402
                                decode_inputs, graph_timer, run_setup)
from dspark.kernels import attention  # noqa: E402

# (name, heads, layer kind) of the cases; layer kind keys attn_batched.LAYERS (rate, top-k).
CASES = (("v4-mini", 32, "csa"), ("v4-flash", 64, "csa"), ("v4-flash", 64, "hca"))
FULL = dict(batches=(1, 8, 64, 256, 512), context=32768, heads={32: 32, 64: 64}, head_dim=HEAD_DIM)
SMOKE = dict(batches=(1, 3), context=1024, heads={32: 4, 64: 8}, head_dim=32)

# Launch shapes of `_wide_kernel` (each compiles for sm_90 without spills, checked offline; shared
# memory: q [64, 512] bf16 64 KB + num_stages × the key tile). block_h "all": every head of a query
# in one program (next power of two, >= 16); "h16": 16-head blocks as the shipped kernel.
VARIANTS = {
    "current": None,
    "all_s3": dict(block_h="all", block_n=32, num_warps=8, num_stages=3),
    "all_s4": dict(block_h="all", block_n=32, num_warps=8, num_stages=4),
    "all_n16_s4": dict(block_h="all", block_n=16, num_warps=8, num_stages=4),
    "all_v2_s4": dict(block_h="all", block_n=32, num_warps=8, num_stages=4, value_split=2),
    "all_v2_s3": dict(block_h="all", block_n=32, num_warps=8, num_stages=3, value_split=2),
    "pad64_s4": dict(block_h=64, block_n=32, num_warps=8, num_stages=4),  # v4-mini: 32 heads on wgmma rows
    "h16_s4": dict(block_h=16, block_n=32, num_warps=8, num_stages=4),
    "all_s4_waves1": dict(block_h="all", block_n=32, num_warps=8, num_stages=4, waves=1),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/attn-variants.json")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter: checks the script")
    p.add_argument("--batches", help="requests per launch, comma-separated (default 1,8,64,256,512)")
    p.add_argument("--variants", help="comma-separated VARIANTS names (default: all)")
    return p.parse_args(argv)


def variant_tiles(spec: dict | None, heads: int) -> attention.Tiles | None:
    """The `Tiles` of a VARIANTS entry for `heads` (None: the shipped `sparse_attention`)."""
    if spec is None:
        return None
    spec = dict(spec)
    if spec["block_h"] == "all":
        spec["block_h"] = max(16, 1 << (heads - 1).bit_length())
    return attention.Tiles(wide=True, **spec)


def run_variant(tiles, q, pool, index, sink, scale):
    if tiles is None:
        return attention.sparse_attention(q, pool, index, sink, scale)
    return attention.launch_sparse_attention(q, pool, index, sink, scale, tiles)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")  # NaN: an element was not written (the memory was poisoned)
    return ((out - ref).norm() / ref.norm()).item()


def case_rows(cfg: dict, variants: dict, device, timer) -> list[dict]:
    scale = cfg["head_dim"] ** -0.5
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, heads_key, kind in CASES:
        heads = cfg["heads"][heads_key]
        rate, topk = LAYERS[kind]
        for batch in cfg["batches"]:
            q, pool, index, sink, _ = decode_inputs(batch, heads, rate, topk, cfg["context"], device, g)
            if cfg["head_dim"] != HEAD_DIM:  # smoke: narrower rows
                q, pool = q[..., : cfg["head_dim"]].contiguous(), pool[:, : cfg["head_dim"]].contiguous()
            check = slice(0, min(batch, 8))
            ref = attention.sparse_attention_ref(q[check], pool, index[check], sink, scale).float()
            current = attention.sparse_attention(q, pool, index, sink, scale).float()
            n_bytes = (batch * index.shape[1] * pool.shape[1] * pool.element_size()  # key rows, each once
                       + 2 * q.numel() * q.element_size() + index.numel() * index.element_size())
            seen = set()
            for variant, spec in variants.items():
                tiles = variant_tiles(spec, heads)
                if tiles in seen:  # "pad64" is "all" at 64 heads
                    continue
                seen.add(tiles)
                row = {"layer": name, "kind": kind, "B": batch, "heads": heads, "keys_per_query": index.shape[1],
                       "context": cfg["context"], "variant": variant,
                       "tiles": None if tiles is None else dataclasses.asdict(tiles), "bytes": n_bytes}
                try:
                    torch.full_like(q, float("nan"))  # freed: the op's output likely lands on NaN memory
                    out = run_variant(tiles, q, pool, index, sink, scale).float()
                    row.update(rel_err_ref=rel(out[check], ref), rel_err_current=rel(out, current))
                    t = timer(lambda: run_variant(tiles, q, pool, index, sink, scale))
                except Exception as exc:  # out of shared memory, a compiler rejection: record, go on
                    row["error"] = repr(exc)[:300]
                    rows.append(row)
                    print(f"{name} {kind} B={batch} {variant}: {row['error']}", flush=True)
                    continue
                row.update(us=t * 1e6, GBps=n_bytes / t / 1e9, pct_hbm=100 * n_bytes / t / HBM_BYTES_PER_S)
                rows.append(row)
                print(f"{name} {kind} B={batch} {variant}: {row['us']:.1f} us ({row['pct_hbm']:.1f}% HBM), "
                      f"rel err {row['rel_err_ref']:.1e} vs ref, {row['rel_err_current']:.1e} vs current", flush=True)
            del q, pool, index, current
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict], variants: dict) -> list[str]:
    """A µs table (case × variant) and the fastest correct variant per case."""
    cases = list(dict.fromkeys((r["layer"], r["kind"], r["B"]) for r in rows))
    lines = ["case | " + " | ".join(variants) + " | best"]
    for case in cases:
        got = {r["variant"]: r for r in rows if (r["layer"], r["kind"], r["B"]) == case}
        ok = {v: r for v, r in got.items() if "us" in r and r["rel_err_ref"] < 2e-2 and r["rel_err_current"] < 2e-2}
        best = min(ok, key=lambda v: ok[v]["us"]) if ok else "-"
        cells = [f"{got[v]['us']:.1f}" if v in got and "us" in got[v] else ("err" if v in got else "=")
                 for v in variants]
        best_cell = f"{best} {ok[best]['pct_hbm']:.1f}%" if ok else "-"
        lines.append(f"{case[0]} {case[1]} B={case[2]} | " + " | ".join(cells) + f" | {best_cell}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    setup = run_setup(args, FULL, SMOKE, "bench/attn_variants.py")
    if setup is None:
        return 2
    cfg, device = setup
    variants = VARIANTS if not args.variants else {v: VARIANTS[v] for v in args.variants.split(",")}
    start = time.time()
    cond = conditions(device)
    print(json.dumps(cond), flush=True)
    with torch.inference_mode():
        rows = case_rows(cfg, variants, device, graph_timer if device.type == "cuda" else cpu_timer)
    lines = summary(rows, variants)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"conditions": cond, "args": vars(args), "variants": variants, "results": rows,
                               "summary": lines}, indent=1))
    print("\n".join(lines))
    print(f"wrote {out} ({len(rows)} rows, {time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
