#!/usr/bin/env bash
# GPU steps of the twenty-sixth session, for one H100 or H200 (every JSON names its card):
#
#   run(command="bash bench/gpu_session26.sh a", carry=[".whl"])   # ≈ 5 min
#
# a: after `moe_shared` and `SparseAttentionFlashinferSink` were removed (both slower in session 25's
#    part a / b) and `engram_gate` left `NOT_YET_ON_GPU`: the GPU tests of the files those changes
#    touched (the MoE kernels and V4.1's fused router, the Engram gate, the flashinfer MLA path, both
#    models' static graphs), then the v41-mini graph step at 1 and 8 requests with the new defaults.
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, with_flashinfer

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  with_flashinfer
  tests a_tests 360 tests/kernels/test_engram_gate.py tests/kernels/test_moe.py tests/kernels/test_attention_flashinfer.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  step a_v41_defaults 130 --config v41-mini --requests 1,8
}

dispatch session26 "${1:-}"
