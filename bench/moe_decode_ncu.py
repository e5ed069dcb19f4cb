"""The decode MoE's two kernels under Nsight Compute: where a one-token FP8 launch spends its time.

    ncu --clock-control none --profile-from-start off --csv --page details \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section InstructionStats --section Occupancy \
        --metrics regex:sm__inst_executed_pipe_.*sum.pct_of_peak_sustained_active \
        python3 bench/moe_decode_ncu.py [--layer v4-flash] [--block 128] [--tokens 1] > ncu.csv

A V4-Flash-like layer (D 4096, I 2048, top-6 of 256 plus the shared expert; `moe_decode_tiles.LAYERS`)
with FP8 weights: `decode_experts` at the shipped shape (`decode_tiles`), first as `moe_experts` alone
calls it, then with `x_ready` (as `fused_moe` calls it: at one token the TMA gate/up launch's EARLY grid,
shared rows first, or the one launch's EARLY form with its counters), each compiled and run once before
the profiled range, then once inside it (`cudaProfilerStart` / `Stop`): the kernel launches of both runs,
named in the CSV by kernel and in launch order. `--no-fused`: the two launches where the tables pick
`moe_decode.FUSED`'s one. Without ncu it only runs. Its first run (`bench/gpu_session17.sh a`,
bench/results/moe-decode-ncu-*-h200.csv) profiled the GEMV kernels against the bit-placed FP8 reads of
commit 44af5c8, since removed; later runs until the forty-second session's, against the same shape with
the column sums deferred (`DecodeTiles.up_defer` / `down_defer`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_decode_tiles import LAYERS, TOP_K, weights  # noqa: E402

from dspark.kernels import moe_decode as md  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", default="v4-flash", choices=tuple(LAYERS))
    ap.add_argument("--block", type=int, default=128, help="FP8 scale block (128 or 32)")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--no-fused", action="store_true",
                    help="the two launches where the tables pick the one-launch kernel (`moe_decode.FUSED`)")
    args = ap.parse_args()
    dim, inter, n_exp = LAYERS[args.layer]
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w2, w3, s1, s2, s3 = weights(dim, inter, n_exp, args.block, g)
    x = torch.randn(args.tokens, dim, generator=g, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(n_exp, device="cuda")[:TOP_K] for _ in range(args.tokens)]).int()
    wts = torch.rand(args.tokens, TOP_K, generator=g, device="cuda") + 0.1
    shipped = md.decode_tiles(args.tokens, args.block, dim)
    shipped = shipped._replace(fused=None) if args.no_fused else shipped
    experts = (x, wts, ids, w1, w2, w3, s1, s2, s3, 10.0, shipped)

    def run(ready):  # with x_ready, as fused_moe: the one launch's counters made first (`fused_counters`)
        counters = md.fused_counters(x, w1, w2, w3, s1, s2, s3, TOP_K) if ready and shipped.fused else None
        return md.decode_experts(*experts, x_ready=ready, counters=counters)

    outs = [run(ready) for ready in (False, True)]  # compile
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for ready in (False, True):
        run(ready)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    err = ((outs[1].float() - outs[0].float()).norm() / outs[0].float().norm()).item()
    print(f"# {args.layer} fp8 block {args.block}, {args.tokens} token(s), tiles {tuple(shipped)}; "
          f"x_ready vs not: relative difference {err:.2e}", file=sys.stderr)


if __name__ == "__main__":
    main()
