#!/usr/bin/env bash
# GPU steps written in the twenty-fifth session and run in the twenty-sixth (H100; every JSON names its card):
#
#   run(command="bash bench/gpu_session25.sh c")   # ≈ 5 min
#   run(command="bash bench/gpu_session25.sh d")   # ≈ 5 min: c's tests and one A/B round, then engram_gate
#   run(command="bash bench/gpu_session25.sh e")   # ≈ 4 min: d's tests, c's A/B once
#
# Parts a (flashinfer's FA2 kernel with its attention-sink variant) and b (the MoE's shared expert on
# a side stream, `moe_shared`) ran at tree 268396b plus the session's uncommitted test fixes; both lost
# their A/B and their code was removed after (`git show 268396b:bench/gpu_session25.sh` has them).
#
# c: V4.1's router on V4's fused `moe_route` (`Gate.fused_route_args`: gate_temp 1, no image tokens,
#    K > 1), where it ran as ~10 torch ops: the V4.1 GPU tests, then the v41-mini graph step at 1 and
#    8 requests with it and with the module gate (the device copy's `fused_route_args` made to return
#    None by sed, then restored), twice in alternation.
# d: the GPU tests of c, one round of its A/B, and v41-mini with V4.1's Engram gate in one launch
#    (`engram_gate`, named explicitly: it was in registry.NOT_YET_ON_GPU when this was written).
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, with_flashinfer

router_ab() {  # router_ab PREFIX LIMIT: v41-mini at 1 and 8 requests, the fused router then the module gate
  local gate=dspark/models/deepseek_v41/moe.py
  cp "$gate" /tmp/v41_moe.py
  step "${1}_fused_router" "$2" --config v41-mini --requests 1,8
  sed -i 's/if self.gate_temp != 1 or self.image_token_id/if True or self.image_token_id/' "$gate"
  step "${1}_module_router" "$2" --config v41-mini --requests 1,8
  cp /tmp/v41_moe.py "$gate"
}

V41_TESTS=(tests/models_v41/test_deepseek_v41_static_graph_gpu.py tests/kernels/test_kernels_model.py
           tests/kernels/test_moe.py tests/kernels/test_engram_gate.py)

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests c_tests 200 tests/models_v41/test_deepseek_v41_static_graph_gpu.py tests/kernels/test_kernels_model.py \
    tests/kernels/test_moe.py -k "v41 or fused_matches"
  router_ab c_1 120
  router_ab c_2 120
}

part_d() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests d_tests 240 "${V41_TESTS[@]}" tests/models/test_deepseek_v4_static_graph_gpu.py \
    -k "v41 or fused_matches or side_streams or v4_mini_shapes or engram or gate"
  router_ab d 120
  step d_v41_engram_gate 120 --config v41-mini --requests 1,8 --triton engram_gate
}

part_e() {  # d's tests and the V4.1 router A/B only (≈ 4 min)
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests e_tests 110 "${V41_TESTS[@]}" -k "v41 or fused_matches or engram or gate"
  router_ab e 70
}

dispatch session25 "${1:-}"
