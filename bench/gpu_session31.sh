#!/usr/bin/env bash
# GPU steps of the thirtieth session, for one H100 or H200 (every JSON names its card):
#
#   run(command="bash bench/gpu_session31.sh a")   # ≈ 5 min; ran (H100): v4-mix-lane-*-h100-s30.json
#   run(command="bash bench/gpu_session29.sh c", kind="nvidia-h200", carry=[".whl"])   # ≈ 4 min, H200 only
#   run(command="bash bench/gpu_session24.sh a", kind="nvidia-h200")       # ≈ 7 min, H200 only
#   run(command="bash bench/gpu_session31.sh b")   # ≈ 6 min; ran (H100, thirty-first session): v4-fold16-ab-h100-s31.json
#
# a: V4's unfolded mHC sites (more than `mhc_norm.FOLD_MAX_TOKENS` = 4 rows: 8 requests, verify blocks)
#    with post and comb on the MIX lane too (`mhc._mhc_epilogue_kernel` ROLE 1 / 2): the GPU tests of
#    mhc and mhc_norm (the epilogue in two launches against one, bit for bit) and of V4's static graph,
#    then the v4-mini graph step at 8 and 16 requests and at 4 requests x 4-token verify blocks with 3,
#    2, 1 and 0 side streams timed in turn in one process (`--side-ab`). 3 lanes against 2 is this
#    change alone: with 2 the MIX lane is inline and the sites keep their one-launch epilogue.
# b: V4's sublayer norm folded into the mHC sites past 4 rows (`--fold-max-tokens`: the row epilogue,
#    one token per program row, at 5-16 rows instead of the unfused site + RMSNorm launch): the
#    mhc_norm GPU tests, then the v4-mini graph step at 8 and 16 requests and at 4 requests x 4-token
#    verify blocks with the fold up to 4 (shipped then) and up to 16 (shipped since), twice in
#    alternation (separate processes).
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, step

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests a_tests 240 tests/kernels/test_mhc.py tests/kernels/test_mhc_norm.py tests/models/test_deepseek_v4_static_graph_gpu.py
  step a_v4_lanes 200 --requests 8,16 --side-ab
  step a_v4_verify_lanes 120 --requests 4 --tokens 4 --side-ab
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests b_tests 150 tests/kernels/test_mhc_norm.py
  local round
  for round in 1 2; do
    step "b_fold4_$round" 100 --requests 8,16 --fold-max-tokens 4
    step "b_fold16_$round" 100 --requests 8,16 --fold-max-tokens 16
    step "b_fold4_verify_$round" 80 --requests 4 --tokens 4 --fold-max-tokens 4
    step "b_fold16_verify_$round" 80 --requests 4 --tokens 4 --fold-max-tokens 16
  done
}

dispatch session31 "${1:-}"
