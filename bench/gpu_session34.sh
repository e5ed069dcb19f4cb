#!/usr/bin/env bash
# GPU steps of the thirty-second session, for one H100 or H200 (every JSON names its card):
# (The GEMV this part measures was taken out after the thirty-third session's run of gpu_session35.sh;
#  the merge commit 334ba5f has it: run this part there.)
#
#   run(command="bash bench/gpu_session34.sh a", carry=[".ab"])   # ≈ 7 min (SKIP_TESTS=1: ≈ 6 min; AB_V41_ROUNDS=0: v4-mini only)
#   (.ab/grouped_wo_a_old.py: `git show <parent>:dspark/kernels/grouped_wo_a.py`, the op before the GEMV)
#
# a: `grouped_wo_a` at 1-4 decode rows as one GEMV launch (`_wo_a_gemv_kernel`: each weight tile read
#    once for every row on the CUDA cores, the rotary channels rotated per element), where the tensor-core
#    kernel split each group's heads into runs and a second launch added their fp32 partials: its GPU
#    tests, then the v41-mini and v4-mini graph steps at 1 and 8 requests with the new op and with the old
#    one, two rounds in alternation (separate processes; `gpu_lib.sh`'s `ab_steps`; 8 requests take the
#    tensor-core kernel either way, a control).
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, ab_steps

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  [ -n "${SKIP_TESTS:-}" ] || tests a_tests 150 tests/kernels/test_grouped_wo_a.py tests/kernels/test_kernels_pdl.py
  ab_steps a 2 dspark/kernels/grouped_wo_a.py
}

dispatch session34 "${1:-}"
