#!/usr/bin/env bash
# GPU steps of the forty-first session (one H100 or H200; every JSON names its card):
#
#   run(command="bash bench/gpu_session45.sh a")   # ≈ 6 min (≈ 9 on an H200)
#
# a: where the decode MoE op's time goes at 1 and 8 tokens (`bench/moe_op_profile.py`: each kernel's
#    duration and the gaps, shipped tables and the GEMV kernels alone); then the decode MoE's GPU tests in
#    full with the shipped `DOWN_TMA` / `FUSED` entries (the fortieth session's unrun part h, including the
#    CUDA test at V4-Flash widths); on an H200 also issue 6's MoE rows (`gpu_lib.moe_rows_h200`).
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, pack, dispatch, moe_rows_h200

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged "moe-op-profile-$(card)-s41" 240 python3 bench/moe_op_profile.py --out "$OUT/moe-op-profile-$(card)-s41.json"
  grep -h "graph" "$W/logs/moe-op-profile-$(card)-s41.txt" | cut -c1-600
  tail -n 2 "$W/logs/moe-op-profile-$(card)-s41.txt" | cut -c1-300
  tests a_tests 150 tests/kernels/test_moe_decode_tma.py tests/kernels/test_moe.py -k "decode or tma"
  moe_rows_h200 s41
}

dispatch session45 "${1:-}"
