#!/usr/bin/env bash
# GPU check of `step_index` (every position-derived index tensor of a static step in one launch,
# NOT_YET_ON_GPU), one part, < 8 min on one H200:
#
#   run(command="bash bench/gpu_step_index.sh", kind="nvidia-h200")
#
# Its GPU tests (the kernel at v4-mini segments against its reference, the compile of its launch for
# sm_90, PDL launches, the static steps' graph tests), then the v4-mini and v41-mini graph steps at 1
# and 8 requests with it and without, and the v4-mini PDL-off profile with it (op_sites: the index
# sites should be one index_select; the 97 torch ops of graph-profile-h200-s9-final-no-pdl.json drop by ~50).
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests


logged si_tests 240 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_step_index.py \
  tests/models/test_deepseek_v4_step_index.py tests/kernels/test_kernels_pdl.py tests/kernels/test_compile_sm90.py \
  tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
tail -n 4 $W/logs/si_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/si_tests.txt | head -n 20 | cut -c1-300
step graph-decode-h200-step-index 100 --requests 1,8 --triton step_index
step graph-decode-h200-step-index-base 100 --requests 1,8
step graph-decode-v41-h200-step-index 100 --config v41-mini --requests 1,8 --triton step_index
step graph-decode-v41-h200-step-index-base 100 --config v41-mini --requests 1,8
step graph-profile-h200-step-index-no-pdl 100 --requests 1 --triton step_index --no-pdl --profile
cp -r $W/logs "$OUT/step-index-logs"
