#!/usr/bin/env bash
# GPU steps written in the twenty-eighth session (not yet run), for one H100 or H200 (every JSON names its card):
#
#   run(command="bash bench/gpu_session29.sh a")                       # ≈ 8 min
#   run(command="bash bench/gpu_session29.sh b")                       # ≈ 2 min
#   run(command="bash bench/gpu_session29.sh c", kind="nvidia-h200", carry=[".whl"])   # ≈ 4 min, H200 only
#   (.whl: `pip download --no-deps flashinfer-python==0.6.18.post1 apache-tvm-ffi==0.1.15.post2
#    --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 -d .whl`)
#
# a: `moe_route_rows` (registry.NOT_YET_ON_GPU): V4.1's gate with an image-token id (the released
#    checkpoint sets one) on the fused router, each token's selection bias row ([N, E]: `bias_vl` on
#    image tokens) loaded in the router kernels' epilogue, where that gate ran as its ~10-op module.
#    Its GPU tests (real shapes, both router kernels), the router, mHC (V4's split up to 16 tokens, whose
#    GPU tests did not run in session 28) and static-graph GPU tests, then the
#    v41-mini graph step at 1 and 8 requests with `--image-token-id 7` and with `--triton
#    moe_route_rows` and without (the module gate), twice in alternation.
# b: the mHC statistics split over the streams past this session's thresholds (V4.1: 8 tokens, V4: 16):
#    the V4.1 site at 16 and 32 tokens with the split forced and 16- or 32-token tiles of 64-wide
#    D-blocks (`bench/mhc_v41_site.py`), and V4's unfolded site at 32 tokens split up to 32
#    (`bench/mhc_norm_site.py --split-streams 32`): whether the thresholds should rise (verify blocks of
#    4 tokens for 4-8 requests, the drafter's γ rows).
# c: on the H200 (the issue's card): flashinfer's MLA decode attention with the sink pass at 32K for
#    256 and 512 requests (`bench/attn_batched.py`), the figure issue 6 still quotes from the sixth
#    session (61-63 % of HBM; 71-73 % for the kernel alone).
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, step, with_flashinfer

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests a_tests 240 tests/kernels/test_kernels_route_decode.py tests/kernels/test_moe.py tests/kernels/test_mhc.py \
    tests/models_v41/test_deepseek_v41_static_graph_gpu.py tests/models/test_deepseek_v4_static_graph_gpu.py
  local round
  for round in 1 2; do
    step "a_v41_rows_$round" 100 --config v41-mini --requests 1,8 --image-token-id 7 --triton moe_route_rows
    step "a_v41_module_$round" 100 --config v41-mini --requests 1,8 --image-token-id 7
  done
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged b_v41_site 200 python3 bench/mhc_v41_site.py --tokens 16,32 --block-d 64/64/4/16,64/64/4/32,64/32/4/32 \
    --out "$OUT/b_v41_site.json"
  grep -h '"n": [0-9]*, "dim": [0-9]*, "unsplit_us' "$W/logs/b_v41_site.txt" | cut -c1-500
  logged b_v4_site 120 python3 bench/mhc_norm_site.py --tokens 32 --dims 2048 --tiles "" --split-streams 32 \
    --out "$OUT/b_v4_site.json"
  grep -h "unfused_us" "$W/logs/b_v4_site.txt" | cut -c1-400
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  with_flashinfer
  logged c_attn 300 python3 bench/attn_batched.py --skip-model --skip-sweep --skip-per-request --batches 256,512 \
    --out "$OUT/c_attn.json"
  grep -h "flashinfer\|copy" "$W/logs/c_attn.txt" | cut -c1-300; tail -n 1 "$W/logs/c_attn.txt"
}

dispatch session29 "${1:-}"
