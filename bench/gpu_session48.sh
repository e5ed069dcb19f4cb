#!/usr/bin/env bash
# GPU steps of the forty-fourth session (one H100 or H200; every JSON names its card):
#
#   run(command="bash bench/gpu_session48.sh a", carry=[".whl"])   # ≈ 7 min on an H200, ≈ 5 on an H100 (the
#                                               # drafter's weights moved out of the tree for the carry limit)
#   run(command="bash bench/gpu_session48.sh b")   # ≈ 6 min
#
# a: (gpu_session49.sh a, then gpu_session50.sh a, replace it) on an H200, issue 6's deciding figures with the forty-third session's early one launch: the V4-Flash MoE
#    rows (`bench/kernels.py --graph`, the whole op with its router at 1, 8 and 64 tokens) after the read flush,
#    the 32K decode attention on flashinfer (graph with the sink pass, and the kernel alone, after either
#    flush), then the MoE rows after the write flush (the figures before the forty-second session were
#    write-flushed). On an H100, part b.
# b: (ran in the forty-fifth session on an H100, through part a; bench README) the TMA kernels' GPU tests with the forty-third session's fixes (41dfd23), issue 6's whole op at one token
#    for the three weight kinds (V4-Flash: as shipped, with none of the early starts, and the two launches with
#    theirs; `bench/moe_decode_tma.py --early`); the one launch, now early, at v4-mini widths (one token; it lost
#    there late, fortieth session: a short gate/up phase leaves little to overlap) against the two launches
#    with their early rows (`--fused --layers v4-mini`: the v4-mini step has no `FUSED` cell); then where the
#    v4-mini batch-1 graph step's time goes on this tree (`bench/graph_decode.py --profile`, PDL on, then off:
#    with PDL a kernel's time includes its wait).
# c (ran once, at baf6157, on one H100; its code is gone): `linear.linear_norm`, q_norm folded into wq_b's GEMV,
#    its GPU tests and `bench/graph_decode.py --requests 1,8 --gemv-ab q_norm_fold` on v4-mini and v41-mini. It
#    lost (bench README, forty-fourth session), so the op, its tests and the variant left the tree after it.
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, step, tests, pack, dispatch, issue6_h200_or,
# tma_tests_then_early

part_a() { issue6_h200_or s44 part_b; }

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tma_tests_then_early "gpu-tests-tma-$(card)-s44" "moe-early-kinds-$(card)-s44"
  logged "moe-fused-mini-$(card)-s44" 150 python3 bench/moe_decode_tma.py --fused --layers v4-mini \
    --kinds bf16,fp8-32,fp8 --tokens 1 --out "$OUT/moe-fused-mini-$(card)-s44.json"
  grep -h "fused\|op " "$W/logs/moe-fused-mini-$(card)-s44.txt" | cut -c1-300 | tail -n 4
  step "v4-profile-pdl-$(card)-s44" 90 --requests 1 --profile
  step "v4-profile-nopdl-$(card)-s44" 90 --requests 1 --profile --no-pdl
}

dispatch session48 "${1:-}"
