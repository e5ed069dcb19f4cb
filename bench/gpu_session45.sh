#!/usr/bin/env bash
# GPU steps of the forty-first session (one H100 or H200; every JSON names its card):
#
#   run(command="bash bench/gpu_session45.sh a")   # ≈ 6 min (≈ 9 on an H200)
#   run(command="bash bench/gpu_session45.sh b")   # ≈ 8 min
#   run(command="bash bench/gpu_session45.sh c")   # ≈ 7 min
#   run(command="bash bench/gpu_session45.sh d")   # ≈ 9 min: b and c's essentials in one call
#   run(command="bash bench/gpu_session45.sh e")   # ≤ 4 min: part a's hang at exit, with stacks
#
# a: where the decode MoE op's time goes at 1 and 8 tokens (`bench/moe_op_profile.py`: each kernel's
#    duration and the gaps, shipped tables and the GEMV kernels alone); then the decode MoE's GPU tests in
#    full with the shipped `DOWN_TMA` / `FUSED` entries (the fortieth session's unrun part h, including the
#    CUDA test at V4-Flash widths); on an H200 also issue 6's MoE rows (`gpu_lib.moe_rows_h200`).
# b: the shared experts' gate/up rows started while the router's last launch runs (`fused_moe`'s `x_ready`,
#    the TMA gate/up kernel's EARLY): issue 6's whole op with it and without, in turn (`bench/moe_decode_tma.py
#    --early`), the profile again, the v4-mini graph step at 1 and 8 requests captured with the promise
#    withheld against the shipped graph, in turn (`bench/graph_decode.py --gemv-ab moe_late`), then the TMA
#    kernels' GPU tests (the new early test among them; part a's run of that file with test_moe.py's decode
#    tests passed every test, then hung at exit until the timeout, so each file runs alone, the GPU's
#    state shown after).
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, step, tests, pack, dispatch, moe_rows_h200

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged "moe-op-profile-$(card)-s41" 240 python3 bench/moe_op_profile.py --out "$OUT/moe-op-profile-$(card)-s41.json"
  grep -h "graph" "$W/logs/moe-op-profile-$(card)-s41.txt" | cut -c1-600
  tail -n 2 "$W/logs/moe-op-profile-$(card)-s41.txt" | cut -c1-300
  tests a_tests 150 tests/kernels/test_moe_decode_tma.py tests/kernels/test_moe.py -k "decode or tma"
  moe_rows_h200 s41
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged "moe-early-$(card)-s41" 200 python3 bench/moe_decode_tma.py --early --out "$OUT/moe-early-$(card)-s41.json"
  grep -h "early" "$W/logs/moe-early-$(card)-s41.txt" | cut -c1-300
  logged "moe-op-profile-early-$(card)-s41" 150 python3 bench/moe_op_profile.py --layers v4-flash --kinds fp8,fp8-32 \
    --out "$OUT/moe-op-profile-early-$(card)-s41.json"
  grep -h "graph" "$W/logs/moe-op-profile-early-$(card)-s41.txt" | cut -c1-600
  step "moe-late-ab-v4-$(card)-s41" 150 --requests 1,8 --gemv-ab moe_late
  grep -h "gemv_ab_ms" "$W"/logs/moe-late-ab-*.txt | cut -c1-500
  tests b_tma 150 tests/kernels/test_moe_decode_tma.py
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
}

part_c() {  # the rest of b's checks: the decode MoE tests of test_moe.py, PDL's, V4's and V4.1's static graphs
  # (bit for bit against the dynamic path, both with the early shared rows), and v41-mini's step A/B
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests c_moe 120 tests/kernels/test_moe.py -k "decode or tma"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  tests c_pdl 100 tests/kernels/test_kernels_pdl.py
  tests c_graphs 150 tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  step "moe-late-ab-v41-$(card)-s41" 150 --config v41-mini --requests 1 --gemv-ab moe_late
  grep -h "gemv_ab_ms" "$W"/logs/moe-late-ab-v41*.txt | cut -c1-500
}

part_d() {  # b and c in one call (≈ 9 min): the op A/B, the v4-mini step A/B at 1 and 8 requests, the TMA
  # kernels' GPU tests, the static graphs (bit for bit), PDL's GPU test
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged "moe-early-$(card)-s41" 170 python3 bench/moe_decode_tma.py --early --out "$OUT/moe-early-$(card)-s41.json"
  grep -h "early" "$W/logs/moe-early-$(card)-s41.txt" | cut -c1-300
  step "moe-late-ab-v4-$(card)-s41" 130 --requests 1,8 --gemv-ab moe_late
  grep -h "gemv_ab_ms" "$W"/logs/moe-late-ab-*.txt | cut -c1-500
  tests d_tma 110 tests/kernels/test_moe_decode_tma.py -k "early or gpu or v4_flash or fused_is"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  tests d_graphs 120 tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  tests d_pdl 45 tests/kernels/test_kernels_pdl.py -k gpu
}

part_e() {  # part a's test run again (it passed every test, then hung until the timeout): the same files and
  # filter, SIGABRT at 200 s so that faulthandler prints every thread's stack, the GPU's load shown at 190 s
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  (sleep 190; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader > "$W/logs/e_gpu_at_190s.txt") &
  timeout -s ABRT 200 python3 -X faulthandler -m pytest -q -p no:cacheprovider -rs --durations=8 \
    tests/kernels/test_moe_decode_tma.py tests/kernels/test_moe.py -k "decode or tma" > "$W/logs/e_tests.txt" 2>&1
  echo "e_tests rc=$?" | tee -a "$W/logs/e_tests.txt"
  grep -v "^\.\+ *\[" "$W/logs/e_tests.txt" | tail -n 40 | cut -c1-200
  wait; cat "$W/logs/e_gpu_at_190s.txt" 2>/dev/null
}

dispatch session45 "${1:-}"
