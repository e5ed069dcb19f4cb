#!/usr/bin/env bash
# GPU steps of the forty-fifth session (every JSON names its card; gpu_session50.sh a and b replace a and b):
#
#   run(command="bash bench/gpu_session49.sh a", carry=[".whl"])   # ≈ 7 min on an H200, ≈ 5 on an H100 (the
#                                               # drafter's weights moved out of the tree for the carry limit)
#   run(command="bash bench/gpu_session49.sh b")   # ≈ 6 min (c: its short form, ≈ 3 min)
#
# a: on an H200, `gpu_session48.sh a` (issue 6's MoE rows after the read and the write flush, the 32K decode
#    attention on flashinfer); on an H100, part b.
# b: the GEMVs' 2048-wide K tiles (`linear.GEMV_K_TILE` 2048: every row count, 8 warps, `grouped_wo_a`'s GEMV too;
#    shipped 1024): the GPU tests of `linear`, `grouped_wo_a` and PDL (rows of multi-row launches bit-equal to
#    one-row launches, at both K tiles), then the v4-mini graph step at 1, 2 and 4 requests (two processes) and
#    v41-mini at one request with the candidate against the shipped tiles (`bench/graph_decode.py --gemv-ab
#    k_tile_2048,head_weights_early`; the second: `side_stream.HEAD_WEIGHTS_EARLY`, a CSA layer's indexer head
#    weights on the KV lane before it waits for c_q); then issue 6's FP8 32×32 op at one token again, whose
#    `early_wait` order was 3.2 µs faster in the session's one run (`bench/moe_decode_tma.py --early`). c: b's
#    short form (the first two test files, one process of each A/B).
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, step, tests, dispatch, issue6_h200_or

part_a() { issue6_h200_or s45 part_b; }

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests "gpu-tests-k-tile-$(card)-s45" 100 -m gpu tests/kernels/test_linear.py tests/kernels/test_grouped_wo_a.py \
    tests/kernels/test_kernels_pdl.py
  step "k-tile-ab-v4-$(card)-s45-1" 130 --requests 1,2,4 --gemv-ab k_tile_2048,head_weights_early
  step "k-tile-ab-v41-$(card)-s45" 100 --config v41-mini --requests 1 --gemv-ab k_tile_2048,head_weights_early
  step "k-tile-ab-v4-$(card)-s45-2" 130 --requests 1,2,4 --gemv-ab k_tile_2048,head_weights_early
  grep -h "gemv_ab_speedup" "$W"/logs/k-tile-ab-*.txt | grep -o '"\(k_tile_2048\|head_weights_early\)": [0-9.]*'
  # the FP8 32x32 op with the select kernel waiting first (`early_wait`), 3.2 us faster in one s45 run: again
  logged "moe-early-fp8-32-$(card)-s45b" 120 python3 bench/moe_decode_tma.py --early --layers v4-flash --kinds fp8-32 \
    --tokens 1 --out "$OUT/moe-early-fp8-32-$(card)-s45b.json"
  grep -h "early" "$W/logs/moe-early-fp8-32-$(card)-s45b.txt" | cut -c1-300 | tail -n 2
}

part_c() {  # part b's short form for the session's last 300 s: the GPU tests and one process of each A/B
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests "gpu-tests-k-tile-$(card)-s45" 70 -m gpu tests/kernels/test_linear.py tests/kernels/test_grouped_wo_a.py
  step "k-tile-ab-v4-$(card)-s45-1" 110 --requests 1,2,4 --gemv-ab k_tile_2048,head_weights_early
  step "k-tile-ab-v41-$(card)-s45" 80 --config v41-mini --requests 1 --gemv-ab k_tile_2048,head_weights_early
  grep -h "gemv_ab_speedup" "$W"/logs/k-tile-ab-*.txt | grep -o '"\(k_tile_2048\|head_weights_early\)": [0-9.]*'
}

dispatch session49 "${1:-}"
