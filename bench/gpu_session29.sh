#!/usr/bin/env bash
# GPU steps written in the twenty-eighth session (not yet run), for one H100 or H200 (every JSON names its card):
#
#   run(command="bash bench/gpu_session29.sh a")   # ≈ 5 min
#
# a: `moe_route_rows` (registry.NOT_YET_ON_GPU): V4.1's gate with an image-token id (the released
#    checkpoint sets one) on the fused router, each token's selection bias row ([N, E]: `bias_vl` on
#    image tokens) loaded in the router kernels' epilogue, where that gate ran as its ~10-op module.
#    Its GPU tests (real shapes, both router kernels), the router and static-graph GPU tests, then the
#    v41-mini graph step at 1 and 8 requests with `--image-token-id 7` and with `--triton
#    moe_route_rows` and without (the module gate), twice in alternation.
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, step

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests a_tests 200 tests/kernels/test_kernels_route_decode.py tests/kernels/test_moe.py \
    tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  local round
  for round in 1 2; do
    step "a_v41_rows_$round" 100 --config v41-mini --requests 1,8 --image-token-id 7 --triton moe_route_rows
    step "a_v41_module_$round" 100 --config v41-mini --requests 1,8 --image-token-id 7
  done
}

dispatch session29 "${1:-}"
