"""The dense projections of a decode or verify step: the few-row Triton GEMV (dspark/kernels/linear.py)
against torch's matmul (cuBLAS), timed as CUDA-graph replays.

    PYTHONPATH=. python bench/linear_decode.py --out $OUT/linear-decode-h200.json   # one H200, ~1 min
    PYTHONPATH=. python bench/linear_decode.py --rows 1,2,4,8 --no-sweep --out $OUT/linear-rows-h200.json

Shapes: v4-mini's and V4-Flash's dense weights (bf16): attention wq_a / wq_b / wkv / wo_b, the
indexer's wq_b and weights_proj, the compressor's wkv (overlapped: 2·d wide), the LM head. Each row:
`us` of the GEMV with its default tiles on every shape, `torch_us`, `linear_picks_gemv` (whether
`linear` runs it there: `gemv_pays`), `pct_hbm` (weight + activations over 4.4 TB/s), `rel_err`
against torch; for v4-mini also a sweep of tiles (`sweep`: tiles -> us). `project` rows: the
compressors' fused projection (`compressor_project`: both weights and the ape bias in one launch)
against its reference (two matmuls, a gather and an add). `us` from `bench.attn_batched.graph_timer`
(L2 flushed, launch overhead removed).

`--rows 1,2,4,8`: every shape at each row count (x [rows, K]): `rows_equal_one_row` (each row of the
multi-row launch bit-identical to a one-row launch on it), `linear_picks_gemv` with GEMV_MAX_ROWS
raised to the largest row count (the K and size rule alone); without `--no-sweep` a small sweep of
multi-row tiles on v4-mini's K >= 2048 weights (`sweep`, `best_tiles`). `project` rows time both
paths into static rings (kv_out / score_out / out_rows, as the static step calls them: the reference
then adds two index_copy_ launches). `wins` (top level) lists per row count the weights where the
GEMV beat cuBLAS and the compressors where the kernel beat the reference: what GEMV_MAX_ROWS and
the routing rules should follow.

`bench/results/linear-decode-h200.json` came from this script as of commit 0f14f31, which also timed a
16-row tensor-core variant at 4, 8 and 16 rows (0.72-1.02× cuBLAS at 8 rows: dropped) and ran with
`--no-sweep`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.attn_batched import HBM_BYTES_PER_S, graph_timer  # noqa: E402
from dspark.kernels import linear as op  # noqa: E402

# name -> (N out, K in)
SHAPES = {
    "v4-mini": {"wq_a": (512, 2048), "wq_b": (16384, 512), "wkv": (512, 2048), "wo_b": (2048, 2048),
                "index_wq_b": (8192, 512), "weights_proj": (64, 2048), "compressor_wkv": (1024, 2048),
                "head": (129280, 2048)},
    "v4-flash": {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
                 "index_wq_b": (8192, 1024), "head": (129280, 4096)},
}
# name -> (W, K): v4-mini's CSA compressor (2·512, overlapped), its indexer's (2·128), HCA's (512); V4-Flash CSA
PROJECT_SHAPES = {"v4-mini": {"csa": (1024, 2048), "indexer": (256, 2048), "hca": (512, 2048)},
                  "v4-flash": {"csa": (1024, 4096)}}
GEMV_SWEEP = [(n, k, w) for n in (1, 2, 4, 8, 16) for k in (256, 512, 1024) for w in (4, 8)]
# Multi-row tiles (BLOCK_N, BLOCK_K, warps): the default's BLOCK_K (1024: rows equal to one-row launches)
# against narrower K tiles, which hold fewer accumulators per row and so fit more weight rows per program.
ROWS_SWEEP = [(1, 1024, 4), (2, 1024, 8), (2, 512, 4), (4, 512, 8), (4, 256, 4), (8, 256, 8)]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def sweep_tiles(fn, tiles_list) -> dict:
    """tiles -> us of fn(tiles) (or the compiler's error), with the best tiles."""
    sweep = {}
    for tiles in tiles_list:
        try:
            sweep[str(tiles)] = graph_timer(lambda: fn(tiles), reps=20) * 1e6
        except Exception as exc:  # a shape the compiler rejects: record, go on
            sweep[str(tiles)] = repr(exc)[:120]
    timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
    return dict(best_tiles=min(timed, key=timed.get) if timed else None, best_us=min(timed.values()) if timed else None,
                sweep=sweep)


def gemv_row(g, model, name, n_out, n_in, rows, sweep: bool) -> dict:
    """One weight at `rows` rows: the GEMV at its default tiles against torch's matmul."""
    weight = (torch.randn(n_out, n_in, generator=g, device="cuda") * n_in ** -0.5).bfloat16()
    x = torch.randn(rows, n_in, generator=g, device="cuda").bfloat16()
    ref = F.linear(x, weight)
    n_bytes = weight.numel() * 2 + rows * (n_in + n_out) * 2
    gemv_s = graph_timer(lambda: op.launch_gemv(x, weight))
    torch_s = graph_timer(lambda: F.linear(x, weight))
    got = op.launch_gemv(x, weight)
    row = dict(model=model, weight=name, n_out=n_out, n_in=n_in, rows=rows, us=gemv_s * 1e6, torch_us=torch_s * 1e6,
               speedup=torch_s / gemv_s, tiles=op.gemv_tiles(n_out, n_in, op._num_sms(x.device), rows),
               linear_picks_gemv=op.gemv_pays(rows, n_out, n_in),
               pct_hbm=100 * n_bytes / gemv_s / HBM_BYTES_PER_S, torch_pct_hbm=100 * n_bytes / torch_s / HBM_BYTES_PER_S,
               rel_err=rel(got, ref))
    if rows > 1:
        row["rows_equal_one_row"] = all(torch.equal(got[i], op.launch_gemv(x[i:i + 1], weight)[0]) for i in range(rows))
    if sweep and model == "v4-mini" and (rows == 1 or n_in >= op.GEMV_MIN_K):
        row.update(sweep_tiles(lambda t: op.launch_gemv(x, weight, t), GEMV_SWEEP if rows == 1 else ROWS_SWEEP))
    return row


def project_row(g, model, name, width, n_in, rows) -> dict:
    """One compressor at `rows` rows: the fused projection against its reference; with rows > 1 both
    store into static rings (the static step's call), at one row as the original bench (fresh outputs)."""
    x = torch.randn(rows, n_in, generator=g, device="cuda").bfloat16()
    wkv, wgate = ((torch.randn(width, n_in, generator=g, device="cuda") * n_in ** -0.5).bfloat16() for _ in range(2))
    ape = torch.randn(4, width, generator=g, device="cuda")
    phase = torch.arange(3, 3 + rows, device="cuda") % 4
    args = (x, wkv, wgate, ape, phase)
    dest = {}
    if rows > 1:
        dest = dict(kv_out=torch.zeros(64, width, dtype=torch.bfloat16, device="cuda"),
                    score_out=torch.zeros(64, width, device="cuda"), out_rows=torch.arange(rows, device="cuda") * 5 + 1)
    fused_s = graph_timer(lambda: op.launch_project(*args, **dest))
    ref_s = graph_timer(lambda: op.compressor_project_ref(*args, **dest))
    got, want = op.launch_project(*args), op.compressor_project_ref(*args)
    row = dict(case="project", model=model, compressor=name, width=width, n_in=n_in, rows=rows, into_rings=bool(dest),
               us=fused_s * 1e6, ref_us=ref_s * 1e6, speedup=ref_s / fused_s, picks_kernel=op.project_pays(rows, width, n_in),
               tiles=op.project_tiles(width, n_in, op._num_sms(x.device), rows),
               rel_err=max(rel(a, b) for a, b in zip(got, want)))
    if rows > 1:
        singles = [op.launch_project(x[i:i + 1], wkv, wgate, ape, phase[i:i + 1]) for i in range(rows)]
        row["rows_equal_one_row"] = all(torch.equal(got[j][i], singles[i][j][0]) for i in range(rows) for j in (0, 1))
    return row


def wins(rows_out: list[dict]) -> dict:
    """rows -> the weights where the GEMV beat cuBLAS and the compressors where the kernel beat the reference."""
    out = {}
    for r in rows_out:
        entry = out.setdefault(str(r["rows"]), {"gemv": [], "project": []})
        if r["speedup"] > 1:
            key = "project" if r.get("case") == "project" else "gemv"
            entry[key].append(f"{r['model']}/{r.get('weight') or r['compressor']} {r['speedup']:.2f}x")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--rows", default="1", help="comma-separated row counts of x, each 1..8 (default 1)")
    cli = ap.parse_args()
    counts = [int(r) for r in cli.rows.split(",")]
    if not all(1 <= r <= op.MAX_ROWS for r in counts):
        raise ValueError(f"--rows must each be 1..{op.MAX_ROWS}, got {cli.rows}")
    op.GEMV_MAX_ROWS = max(counts)  # `linear_picks_gemv` then reports the K and size rule at every count
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for rows in counts:
        for model, shapes in SHAPES.items():
            for name, (n_out, n_in) in shapes.items():
                rows_out.append(gemv_row(g, model, name, n_out, n_in, rows, not cli.no_sweep))
                print(json.dumps({k: v for k, v in rows_out[-1].items() if k != "sweep"}), flush=True)
        for model, shapes in PROJECT_SHAPES.items():
            for name, (width, n_in) in shapes.items():
                rows_out.append(project_row(g, model, name, width, n_in, rows))
                print(json.dumps(rows_out[-1]), flush=True)
    result = {"conditions": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
                             "timer": "graph_timer (CUDA-graph replays, L2 flushed)",
                             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
              "wins": wins(rows_out), "rows": rows_out}
    print(json.dumps(result["wins"], indent=1), flush=True)
    with open(cli.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
