#!/usr/bin/env bash
# GPU steps of the twenty-sixth session, for one H100 or H200 (every JSON names its card):
#
#   run(command="bash bench/gpu_session26.sh a", carry=[".whl"])   # ≈ 5 min
#   run(command="bash bench/gpu_session26.sh b", carry=[".ab"])    # ≈ 5 min, after, on this machine:
#     mkdir -p .ab && git show 15d8cc8:dspark/models/deepseek_v41/static_step.py \
#       | sed 's/StaticStepOutput, offset_rows/StaticStepOutput/' > .ab/v41_static_step_old.py
#     printf '\n\ndef offset_rows(rows, offset):\n    return torch.where(rows >= 0, rows + offset, rows)\n' \
#       >> .ab/v41_static_step_old.py   # (offset_rows left deepseek_v4.static_step with its last caller)
#   run(command="bash bench/gpu_session26.sh c")                    # ≈ 4 min
#
# a: after `moe_shared` and `SparseAttentionFlashinferSink` were removed (both slower in session 25's
#    part a / b) and `engram_gate` left `NOT_YET_ON_GPU`: the GPU tests of the files those changes
#    touched (the MoE kernels and V4.1's fused router, the Engram gate, the flashinfer MLA path, both
#    models' static graphs), then the v41-mini graph step at 1 and 8 requests with the new defaults.
# b: V4.1's static step with the picks written into the planned key list (the selection kernel's
#    `offset` / `out`; a sharing layer shifts them in place: no cat, no offset ops) and the window rows
#    rounded straight into the ring (`cache_round(out=, out_rows=)`: no index_copy_): the GPU tests
#    of the V4.1 static step, `cache_round` and the step-index op, then the v41-mini graph step at
#    1 and 8 requests with it and with the step before (`.ab/v41_static_step_old.py`, carried
#    uncommitted: static_step.py before this change, commit 15d8cc8, whose Engram hashing is the
#    torch code that `engram_rows_ref` now holds), twice in alternation; then one profiled
#    v41-mini step at 1 request (`--profile --no-pdl`: per-kernel times, the torch ops by site).
# c: V4.1's Engram n-gram rows in one launch (`engram_rows`, in registry.NOT_YET_ON_GPU): its GPU tests
#    (the kernel against the reference, the V4.1 static step with it, its PDL launches), then the
#    v41-mini graph step at 1 and 8 requests without it and with it (`--triton engram_rows`), twice
#    in alternation.
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, with_flashinfer

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  with_flashinfer
  tests a_tests 360 tests/kernels/test_engram_gate.py tests/kernels/test_moe.py tests/kernels/test_attention_flashinfer.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  step a_v41_defaults 130 --config v41-mini --requests 1,8
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests b_tests 200 tests/models_v41/test_deepseek_v41_static_graph_gpu.py tests/kernels/test_cache_round.py \
    tests/kernels/test_step_index.py tests/kernels/test_static_step_kernels.py
  local file=dspark/models/deepseek_v41/static_step.py
  cp "$file" /tmp/v41_static_step_new.py
  for round in 1 2; do
    step "b_new_$round" 100 --config v41-mini --requests 1,8
    cp .ab/v41_static_step_old.py "$file"
    step "b_old_$round" 100 --config v41-mini --requests 1,8
    cp /tmp/v41_static_step_new.py "$file"
  done
  step b_profile 100 --config v41-mini --requests 1 --profile --no-pdl  # where the V4.1 step's time goes now
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests c_tests 150 tests/kernels/test_engram_rows.py tests/kernels/test_static_step_kernels.py \
    tests/models_v41/test_deepseek_v41_static_graph_gpu.py tests/kernels/test_kernels_pdl.py
  for round in 1 2; do
    step "c_held_$round" 100 --config v41-mini --requests 1,8
    step "c_engram_rows_$round" 100 --config v41-mini --requests 1,8 --triton engram_rows
  done
}

dispatch session26 "${1:-}"
