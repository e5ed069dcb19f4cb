#!/usr/bin/env bash
# GPU steps of the forty-fourth session (one H100 or H200; every JSON names its card):
#
#   run(command="bash bench/gpu_session48.sh a", carry=[".whl"])   # ≈ 7 min on an H200, ≈ 5 on an H100 (the
#                                               # drafter's weights moved out of the tree for the carry limit)
#   run(command="bash bench/gpu_session48.sh b")   # ≈ 6 min
#   run(command="bash bench/gpu_session48.sh c")   # ≈ 5 min
#
# a: on an H200, issue 6's deciding figures with the forty-third session's early one launch: the V4-Flash MoE
#    rows (`bench/kernels.py --graph`, the whole op with its router at 1, 8 and 64 tokens) after the read flush,
#    the 32K decode attention on flashinfer (graph with the sink pass, and the kernel alone, after either
#    flush), then the MoE rows after the write flush (the figures before the forty-second session were
#    write-flushed). On an H100, part b.
# b: the TMA kernels' GPU tests with the forty-third session's fixes (41dfd23), issue 6's whole op at one token
#    for the three weight kinds (V4-Flash: as shipped, with none of the early starts, and the two launches with
#    theirs; `bench/moe_decode_tma.py --early`); the one launch, now early, at v4-mini widths (one token; it lost
#    there late, fortieth session: a short gate/up phase leaves little to overlap) against the two launches
#    with their early rows (`--fused --layers v4-mini`: the v4-mini step has no `FUSED` cell); then where the
#    v4-mini batch-1 graph step's time goes on this tree (`bench/graph_decode.py --profile`, PDL on, then off: with PDL a kernel's time includes its wait).
# c: q_norm folded into wq_b's GEMV (`linear.linear_norm`, written in the forty-fourth session with no GPU lent,
#    so the device's kernel config keeps it off: `registry.NOT_YET_ON_GPU`): its GPU tests (kernel, op, the V4
#    and V4.1 static steps with and without it), then the v4-mini and v41-mini graph steps at 1 and 8 requests
#    captured with it against the shipped graph, in turn (`bench/graph_decode.py --gemv-ab q_norm_fold`; at
#    8 requests the K = 512 wq_b takes no GEMV, so nothing folds: the control).
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, step, tests, pack, dispatch, moe_rows_h200, attention_32k,
# tma_tests_then_early

part_a() {
  if [ "$(card)" = h200 ]; then
    moe_rows_h200 s44  # the read flush, `bench/kernels.py`'s default
    attention_32k s44
    moe_rows_h200 s44 write
  else
    part_b
  fi
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tma_tests_then_early "gpu-tests-tma-$(card)-s44" "moe-early-kinds-$(card)-s44"
  logged "moe-fused-mini-$(card)-s44" 150 python3 bench/moe_decode_tma.py --fused --layers v4-mini \
    --kinds bf16,fp8-32,fp8 --tokens 1 --out "$OUT/moe-fused-mini-$(card)-s44.json"
  grep -h "fused\|op " "$W/logs/moe-fused-mini-$(card)-s44.txt" | cut -c1-300 | tail -n 4
  step "v4-profile-pdl-$(card)-s44" 90 --requests 1 --profile
  step "v4-profile-nopdl-$(card)-s44" 90 --requests 1 --profile --no-pdl
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests "gpu-tests-linear-norm-$(card)-s44" 200 tests/kernels/test_linear_norm.py tests/kernels/test_linear.py \
    tests/engine/test_graph_decode_bench.py
  step "q-norm-fold-ab-v4-$(card)-s44" 120 --requests 1,8 --gemv-ab q_norm_fold
  step "q-norm-fold-ab-v41-$(card)-s44" 150 --config v41-mini --requests 1,8 --gemv-ab q_norm_fold
  grep -h "gemv_ab_ms" "$W"/logs/q-norm-fold-ab-*.txt | cut -c1-500
}

dispatch session48 "${1:-}"
