#!/usr/bin/env bash
# GPU steps of the twenty-fifth session, for one H200 (an H100 runs them too; every JSON names its card):
#
#   run(command="bash bench/gpu_session25.sh a", carry=[".whl"])   # ≈ 6 min (flashinfer JIT compiles)
#   run(command="bash bench/gpu_session25.sh b")                    # ≈ 6 min
#   run(command="bash bench/gpu_session25.sh c")                    # ≈ 5 min
#   run(command="bash bench/gpu_session25.sh d")                    # ≈ 7 min: b and c in one call, one round each
#   run(command="bash bench/gpu_session25.sh e")                    # ≈ 4 min: d's tests, c's A/B once
#
# a: flashinfer's attention-sink variant (`SparseAttentionFlashinferSink`: the FA2 batch prefill kernel,
#    head_dim 512, the sink inside the kernel) against the MLA kernels + sink pass, both timed in one
#    process at 32K context, 8 / 128 / 256 / 512 requests (`bench/attn_batched.py --flashinfer
#    mla,fa2_sink`); then both paths' GPU tests against the reference.
# b: the MoE's shared expert on a side stream beside its router (`moe_shared`, in registry.NOT_YET_ON_GPU):
#    its GPU tests (the kernels against the references, the static graphs with it on lane 0 bit for bit),
#    the V4-Flash MoE op with the router at 1 and 8 tokens with it and without (`bench/kernels.py --graph`,
#    bf16 / FP8 128 / FP8 32), then the v4-mini graph step at 1 and 8 requests without it and with it
#    (`--triton moe_shared`), twice in alternation (separate processes).
# c: V4.1's router on V4's fused `moe_route` (`Gate.fused_route_args`: gate_temp 1, no image tokens,
#    K > 1), where it ran as ~10 torch ops: the V4.1 GPU tests, then the v41-mini graph step at 1 and
#    8 requests with it and with the module gate (the device copy's `fused_route_args` made to return
#    None by sed, then restored), twice in alternation.
# d: for a short budget, the GPU tests of b and c, then one round of each A/B (no kernels.py); and V4.1's
#    Engram gate in one launch (`engram_gate`, in registry.NOT_YET_ON_GPU): its tests, v41-mini with it.
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, with_flashinfer

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  with_flashinfer
  logged a_attn 420 python3 bench/attn_batched.py --skip-model --skip-sweep --skip-per-request --skip-triton \
    --flashinfer mla,fa2_sink --batches 8,128,256,512 --out "$OUT/attn-fa2-sink.json"
  grep -h "attn_flashinfer\|wrote\|Error\|error" "$W/logs/a_attn.txt" | cut -c1-260 | tail -n 60
  tests a_tests 120 tests/kernels/test_attention_flashinfer.py -m gpu
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests b_tests 200 tests/kernels/test_moe.py -k "shared or v4_mini_shapes" tests/models/test_deepseek_v4_static_graph_gpu.py
  logged b_moe 200 python3 bench/kernels.py --configs flash --tokens 1,8 --model-steps 0 --graph \
    --ops fused_moe,fused_moe_beside,fused_moe_fp8_128,fused_moe_fp8_128_beside,fused_moe_fp8_32,fused_moe_fp8_32_beside \
    --out "$OUT/moe-shared-beside.json"
  grep -h "fused_moe" "$W/logs/b_moe.txt" | cut -c1-220 | tail -n 16
  for round in 1 2; do
    step "b_held_$round" 100 --requests 1,8
    step "b_shared_$round" 100 --requests 1,8 --triton moe_shared
  done
}

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
    -k "v41 or fused_matches or shared or side_streams or v4_mini_shapes or engram or gate"
  step d_held 100 --requests 1,8
  step d_shared 100 --requests 1,8 --triton moe_shared
  router_ab d 120
  step d_v41_engram_gate 120 --config v41-mini --requests 1,8 --triton engram_gate
}

part_e() {  # d's tests and the V4.1 router A/B only (≈ 4 min)
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests e_tests 110 "${V41_TESTS[@]}" -k "v41 or fused_matches or shared or engram or gate"
  router_ab e 70
}

dispatch session25 "${1:-}"
