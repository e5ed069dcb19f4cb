"""The dense projections of a batch-1 decode step: the one-row Triton GEMV (dspark/kernels/linear.py)
against torch's matmul (cuBLAS), timed as CUDA-graph replays.

    PYTHONPATH=. python bench/linear_decode.py --out $OUT/linear-decode-h200.json   # one H200, ~1 min

Shapes: v4-mini's and V4-Flash's dense weights (bf16): attention wq_a / wq_b / wkv / wo_b, the
indexer's wq_b and weights_proj, the compressor's wkv (overlapped: 2·d wide), the LM head. Each row:
`us` of the GEMV with its default tiles on every shape, `torch_us`, `linear_picks_gemv` (whether
`linear` runs it there: `gemv_pays`), `pct_hbm` (weight + activations over 4.4 TB/s), `rel_err`
against torch; for v4-mini also a sweep of tiles (`sweep`: tiles -> us). `project` rows: the
compressors' fused projection (`compressor_project`: both weights and the ape bias in one launch)
against its reference (two matmuls, a gather and an add). `us` from `bench.attn_batched.graph_timer`
(L2 flushed, launch overhead removed).

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
            x = torch.randn(1, n_in, generator=g, device="cuda").bfloat16()
            ref = F.linear(x, weight)
            n_bytes = weight.numel() * 2 + (n_in + n_out) * 2
            gemv_s = graph_timer(lambda: op.launch_gemv(x, weight))
            torch_s = graph_timer(lambda: F.linear(x, weight))
            row = dict(model=model, weight=name, n_out=n_out, n_in=n_in, rows=1, us=gemv_s * 1e6,
                       torch_us=torch_s * 1e6, speedup=torch_s / gemv_s,
                       linear_picks_gemv=op.gemv_pays(1, n_out, n_in),
                       pct_hbm=100 * n_bytes / gemv_s / HBM_BYTES_PER_S,
                       torch_pct_hbm=100 * n_bytes / torch_s / HBM_BYTES_PER_S,
                       rel_err=rel(op.launch_gemv(x, weight), ref))
            if not cli.no_sweep and model == "v4-mini":
                sweep = {}
                for tiles in GEMV_SWEEP:
                    try:
                        sweep[str(tiles)] = graph_timer(lambda: op.launch_gemv(x, weight, tiles), reps=20) * 1e6
                    except Exception as exc:  # a shape the compiler rejects: record, go on
                        sweep[str(tiles)] = repr(exc)[:120]
                timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
                row["best_tiles"] = min(timed, key=timed.get) if timed else None
                row["best_us"] = min(timed.values()) if timed else None
                row["sweep"] = sweep
            rows_out.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
    for model, shapes in PROJECT_SHAPES.items():
        for name, (width, n_in) in shapes.items():
            x = torch.randn(1, n_in, generator=g, device="cuda").bfloat16()
            wkv, wgate = ((torch.randn(width, n_in, generator=g, device="cuda") * n_in ** -0.5).bfloat16()
                          for _ in range(2))
            ape = torch.randn(4, width, generator=g, device="cuda")
            phase = torch.tensor([3], device="cuda")
            args = (x, wkv, wgate, ape, phase)
            fused_s = graph_timer(lambda: op.launch_project(*args))
            ref_s = graph_timer(lambda: op.compressor_project_ref(*args))
            got, want = op.launch_project(*args), op.compressor_project_ref(*args)
            row = dict(case="project", model=model, compressor=name, width=width, n_in=n_in, us=fused_s * 1e6,
                       ref_us=ref_s * 1e6, speedup=ref_s / fused_s, picks_kernel=op.gemv_pays(1, 2 * width, n_in),
                       rel_err=max(rel(a, b) for a, b in zip(got, want)))
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    result = {"conditions": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
                             "timer": "graph_timer (CUDA-graph replays, L2 flushed)",
                             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
              "rows": rows_out}
    with open(cli.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
