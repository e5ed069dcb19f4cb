#!/usr/bin/env bash
# GPU steps of the thirty-third session, for one H100 or H200 (every JSON names its card):
# (Ran in the thirty-third session, V41_ROUNDS=0, on an H100: bench/README.md. The three folds were then
#  taken out; the merge commit 334ba5f has them: run this part there.)
#
#   run(command="bash bench/gpu_session35.sh a", carry=[".ab"])   # ≈ 7 min (V41_ROUNDS=0: v4-mini only)
#   (.ab/main: the package of the commit to compare with, without its assets:
#    `mkdir -p .ab/main && git archive main dspark | tar -x -C .ab/main && rm -rf .ab/main/dspark/assets`)
#
# a: three launch folds of the batch-1 step, each CPU-tested only: `grouped_wo_a` at 1-4 rows as one
#    GEMV launch (no partial-sum launch), the decode router as one launch (`route_decode(tickets=)`: the
#    last logits program to take a ticket runs the select), and wq_a with q_norm as one launch
#    (`linear_rms_norm`: the last GEMV program normalises the row; in registry.NOT_YET_ON_GPU, so the
#    steps pass --not-yet). Their GPU tests (real shapes, graph replays, the static graphs bit for bit),
#    then the v4-mini (2 rounds) and v41-mini (1 round) graph steps at 1 and 8 requests with this tree
#    and with .ab/main, alternating (`gpu_lib.sh`'s `ab_trees`).
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, ab_trees

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  [ -n "${SKIP_TESTS:-}" ] || tests a_tests 200 tests/kernels/test_grouped_wo_a.py tests/kernels/test_kernels_route_decode.py \
    tests/kernels/test_linear_rms_norm.py tests/kernels/test_kernels_pdl.py tests/models/test_deepseek_v4_static_graph_gpu.py
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null  # back even if the call runs out of time before `pack`
  ab_trees a "${V41_ROUNDS:-1}" 2 --not-yet
}

dispatch session35 "${1:-}"
