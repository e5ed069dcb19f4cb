#!/usr/bin/env bash
# GPU steps of the fortieth session (one H100 or H200; every JSON names its card):
#
#   run(command="bash bench/gpu_session44.sh a")   # ≈ 8 min
#   run(command="bash bench/gpu_session44.sh b")   # ≈ 7 min
#   run(command="bash bench/gpu_session44.sh c")   # ≈ 3 min, an H200 only (else it does nothing)
#   run(command="bash bench/gpu_session44.sh d")   # ≈ 4 min
#   run(command="bash bench/gpu_session44.sh e")   # ≈ 6 min
#   run(command="bash bench/gpu_session44.sh f")   # ≈ 6 min: c + the v4-mini step A/B on an H200, else e
#   run(command="bash bench/gpu_session44.sh g")   # ≈ 5 min: c or the static graph tests, + the step A/B
#   run(command="bash bench/gpu_session44.sh h")   # ≈ 2 min: e's tests alone
#
# a: the split TMA down kernel (`moe_decode_tma.tma_down`, then outside the tables) over
#    `DOWN_SWEEP` × 1 / 2 / 4 / 7 programs per row block against the GEMV down kernel, each alone, then the
#    experts op with the best of it against the shipped op, and issue 6's whole op (router included) with
#    it in the tables (`moe_decode.DOWN_TMA`) and without, each pair in turn (`bench/moe_decode_tma.py
#    --down`); then the TMA kernels' GPU tests (test_moe_decode_tma.py).
# b: the experts in one launch (`moe_decode_tma.tma_fused`: gate/up items first, then down items, each of
#    which waits for its own row's h; then outside the tables): its GPU tests, then against the
#    shipped two launches at `FUSED_DOWN`'s shapes, and issue 6's whole op with it in `decode_experts`'
#    place and as shipped, each in turn (`bench/moe_decode_tma.py --fused`).
# e: the TMA down launch shipped for dense weights at 8 tokens (`moe_decode.DOWN_TMA`): the decode MoE's GPU
#    tests and V4's and V4.1's static graphs (bit for bit against the dynamic path), then the v4-mini graph
#    step at 1 and 8 requests and v41-mini's at 8, each captured with the GEMV down kernel against the shipped
#    graph, in turn (`bench/graph_decode.py --gemv-ab moe_down_gemv`).
# d: the TMA gate/up kernel alone over more shapes (8-row programs, 3 / 5 / 7 stages) against the GEMV
#    kernel (`bench/moe_decode_tma.py`).
# c: on an H200, issue 6's MoE rows as the thirty-sixth session measured them (`bench/kernels.py --graph`,
#    V4-Flash, the whole op with the router at 1, 8 and 64 tokens), with the decode tables of this commit.
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, step, pack, dispatch, moe_rows_h200

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged "moe-tma-down-$(card)-s40" 450 python3 bench/moe_decode_tma.py --down --out "$OUT/moe-tma-down-$(card)-s40.json"
  grep -h "down gemv" "$W/logs/moe-tma-down-$(card)-s40.txt" | cut -c1-420
  tail -n 2 "$W/logs/moe-tma-down-$(card)-s40.txt" | cut -c1-300
  tests tma_tests 100 tests/kernels/test_moe_decode_tma.py
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests fused_tests 120 tests/kernels/test_moe_decode_tma.py -k fused
  grep -q "fused_tests rc=0" "$W/logs/fused_tests.txt" || return 0  # a wrong or stuck kernel: nothing to time
  logged "moe-fused-$(card)-s40" 420 python3 bench/moe_decode_tma.py --fused --out "$OUT/moe-fused-$(card)-s40.json"
  grep -h "fused best" "$W/logs/moe-fused-$(card)-s40.txt" | cut -c1-420
  tail -n 2 "$W/logs/moe-fused-$(card)-s40.txt" | cut -c1-300
}

part_d() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged "moe-tma-up-$(card)-s40" 400 python3 bench/moe_decode_tma.py --out "$OUT/moe-tma-up-$(card)-s40.json"
  grep -h "up gemv" "$W/logs/moe-tma-up-$(card)-s40.txt" | cut -c1-300
}

part_c() {  # an H200 only (issue 6's card)
  moe_rows_h200 s40
}

part_e() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests e_tests 120 tests/kernels/test_moe_decode_tma.py tests/kernels/test_moe.py -k "decode or tma"
  tests e_graphs 120 tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  step "moe-down-ab-v4-$(card)-s40" 150 --requests 1,8 --gemv-ab moe_down_gemv
  step "moe-down-ab-v41-$(card)-s40" 120 --config v41-mini --requests 8 --gemv-ab moe_down_gemv
  grep -h "gemv_ab_ms" "$W"/logs/moe-down-ab-*.txt | cut -c1-500
}

part_f() {  # whichever card comes: on an H200 part c, then the v4-mini step at 8 requests with and without the
  # TMA down launch, in turn; elsewhere part e
  if [ "$(card)" = h200 ]; then
    part_c
    step "moe-down-ab-v4-h200-s40" 150 --requests 8 --gemv-ab moe_down_gemv
    grep -h "gemv_ab_ms" "$W"/logs/moe-down-ab-*.txt | cut -c1-500
  else
    part_e
  fi
}

part_g() {  # f in under 7 min: on an H200 part c, else V4's and V4.1's static graph tests; then the v4-mini
  # step at 8 requests with and without the TMA down launch, in turn
  if [ "$(card)" = h200 ]; then
    part_c
  else
    tests g_graphs 120 tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  fi
  step "moe-down-ab-v4-$(card)-s40" 150 --requests 8 --gemv-ab moe_down_gemv
  grep -h "gemv_ab_ms" "$W"/logs/moe-down-ab-*.txt | cut -c1-500
}

part_h() {  # e's tests alone
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests h_tests 150 tests/kernels/test_moe_decode_tma.py tests/kernels/test_moe.py -k "decode or tma"
}

dispatch session44 "${1:-}"
