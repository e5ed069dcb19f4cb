"""The dense projections of a decode step at 1..16 rows: the few-row Triton kernels
(dspark/kernels/linear.py) against torch's matmul (cuBLAS), timed as CUDA-graph replays.

    PYTHONPATH=. python bench/linear_decode.py --out $OUT/linear-decode-h200.json   # one H200, ~1 min

Shapes: v4-mini's and V4-Flash's dense weights (bf16): attention wq_a / wq_b / wkv / wo_b, the
indexer's wq_b and weights_proj, the compressor's wkv (overlapped: 2·d wide), the LM head. Each row:
`us` of the default tiles and of torch, `pct_hbm` (weight + activations over 4.4 TB/s), `rel_err`
against torch; at 1 and 4 rows also a sweep of tiles (`sweep`: tiles -> us), so the defaults can be
checked. `us` from `bench.attn_batched.graph_timer` (L2 flushed, launch overhead removed).
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
ROWS = (1, 4, 8, 16)
GEMV_SWEEP = [(n, k, w) for n in (1, 2, 4, 8, 16) for k in (256, 512, 1024) for w in (4, 8)]
SKINNY_SWEEP = [(n, k, w, s) for n in (16, 32, 64) for k in (64, 128, 256) for w in (4,) for s in (3, 4)]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-sweep", action="store_true")
    cli = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for model, shapes in SHAPES.items():
        for name, (n_out, n_in) in shapes.items():
            weight = (torch.randn(n_out, n_in, generator=g, device="cuda") * n_in ** -0.5).bfloat16()
            for rows in ROWS:
                x = torch.randn(rows, n_in, generator=g, device="cuda").bfloat16()
                ref = F.linear(x, weight)
                n_bytes = weight.numel() * 2 + (rows * (n_in + n_out)) * 2
                fused_s = graph_timer(lambda: op.linear(x, weight))
                torch_s = graph_timer(lambda: F.linear(x, weight))
                row = dict(model=model, weight=name, n_out=n_out, n_in=n_in, rows=rows,
                           us=fused_s * 1e6, torch_us=torch_s * 1e6, speedup=torch_s / fused_s,
                           pct_hbm=100 * n_bytes / fused_s / HBM_BYTES_PER_S,
                           torch_pct_hbm=100 * n_bytes / torch_s / HBM_BYTES_PER_S,
                           rel_err=rel(op.linear(x, weight), ref))
                if not cli.no_sweep and rows in (1, 4) and model == "v4-mini":
                    variants = GEMV_SWEEP if rows == 1 else SKINNY_SWEEP
                    sweep = {}
                    for tiles in variants:
                        try:
                            sweep[str(tiles)] = graph_timer(lambda: op.launch_linear(x, weight, tiles), reps=20) * 1e6
                        except Exception as exc:  # a shape the compiler rejects: record, go on
                            sweep[str(tiles)] = repr(exc)[:120]
                    timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
                    row["best_tiles"] = min(timed, key=timed.get) if timed else None
                    row["best_us"] = min(timed.values()) if timed else None
                    row["sweep"] = sweep
                rows_out.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
    result = {"conditions": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
                             "timer": "graph_timer (CUDA-graph replays, L2 flushed)",
                             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
              "rows": rows_out}
    with open(cli.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
