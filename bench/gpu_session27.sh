#!/usr/bin/env bash
# GPU steps of the twenty-seventh session, for one H100 or H200 (every JSON names its card):
#
#   git show 918ea76:dspark/kernels/cache_round.py > .ab/cache_round_old.py   # on this machine first
#   run(command="bash bench/gpu_session27.sh a", carry=[".ab"])   # ≈ 2 min
#   run(command="bash bench/gpu_session27.sh b", carry=[".ab"])   # ≈ 9 min
#   git show 2970274:dspark/kernels/indexer.py > .ab/indexer_old.py     # part c's own .ab (replaces b's)
#   git show 2970274:dspark/kernels/indexer_pool.py > .ab/indexer_pool_old.py
#   run(command="bash bench/gpu_session27.sh c", carry=[".ab"])   # ≈ 7 min
#   run(command="bash bench/gpu_session27.sh d")                    # ≈ 8 min (not run: no device time left)
#
# a: the launch shapes of the v41-mini step's top-k selection (warps per program) and cache rounding
#    (blocks per program; and the kernel before its per-value divisions became reciprocal products,
#    `.ab/cache_round_old.py`) at the step's shapes (`bench/select_round_sweep.py`).
# b: with the shapes part a picked as the shipped defaults: the GPU tests of the two kernels (and of
#    the static graphs that run them), then the v41-mini and v4-mini graph steps at 1 and 8 requests
#    with the new kernels and with both files as they were at 918ea76 (`.ab/indexer_old.py`,
#    `.ab/cache_round_old.py`), twice in alternation.
# c: the selection with the row in two register tiles (a power of two and the rest rounded up:
#    4 160 entries as 4 096 + 64, not 8 192; 8 208 in registers, not streamed): the GPU tests of the
#    indexer, its candidate pool and both static graphs; the selection cells of the sweep against
#    the kernel before (`.ab/indexer_old.py`, commit 2970274); the v41-mini graph step with it and
#    without it (both files of 2970274), twice in alternation, and v4-mini once each.
# d: two ops in registry.NOT_YET_ON_GPU: V4.1's ratio-2 compressor projections as one `_project_kernel`
#    launch storing fp32 rows into the rings (`compressor_project_fp32`), and the indexers' head
#    weights with the cast and the scale in the GEMV's epilogue (`linear_scaled`, V4 and V4.1): their
#    GPU tests and the static graphs', then the v41-mini graph step at 1 and 8 requests with both
#    (`--triton compressor_project_fp32,linear_scaled`) and without, twice in alternation, v4-mini with
#    `--triton linear_scaled` and without once each, and one profiled v41-mini step with both.
#    (V4.1's indexer / ratio-1 compressor projections on the registry's Linear are in every column.)
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, step, swap, ab_steps

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged a_sweep 200 python3 bench/select_round_sweep.py --former-round .ab/cache_round_old.py --out "$OUT/a_sweep.json"
  grep -h "^select_topk\|^cache_round\|wrote\|Error" "$W/logs/a_sweep.txt" | cut -c1-300
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests b_tests 200 tests/kernels/test_cache_round.py tests/kernels/test_lightning_indexer.py \
    tests/kernels/test_static_step_kernels.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py
  ab_steps b 2 dspark/kernels/indexer.py dspark/kernels/cache_round.py
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests c_tests 200 tests/kernels/test_lightning_indexer.py tests/kernels/test_indexer_pool.py \
    tests/models_v41/test_deepseek_v41_static_graph_gpu.py tests/models/test_deepseek_v4_static_graph_gpu.py
  logged c_sweep 120 python3 bench/select_round_sweep.py --select-only --former-select .ab/indexer_old.py \
    --out "$OUT/c_sweep.json"
  grep -h "^select_topk\|wrote\|Error" "$W/logs/c_sweep.txt" | cut -c1-300
  ab_steps c 1 dspark/kernels/indexer.py dspark/kernels/indexer_pool.py
}

part_d() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests d_tests 200 tests/kernels/test_linear.py tests/kernels/test_static_step_kernels.py \
    tests/models_v41/test_deepseek_v41_static_graph_gpu.py tests/models/test_deepseek_v4_static_graph_gpu.py
  local both=compressor_project_fp32,linear_scaled
  for round in 1 2; do
    step "d_v41_on_$round" 100 --config v41-mini --requests 1,8 --triton "$both"
    step "d_v41_held_$round" 100 --config v41-mini --requests 1,8
  done
  step d_v4_on 80 --requests 1,8 --triton linear_scaled
  step d_v4_held 80 --requests 1,8
  step d_profile 100 --config v41-mini --requests 1 --triton "$both" --profile --no-pdl
}

dispatch session27 "${1:-}"
