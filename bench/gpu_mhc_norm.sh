#!/usr/bin/env bash
# GPU steps of mhc_pre_norm / mhc_post_pre_norm (V4 mHC sites with attn_norm / ffn_norm folded into the
# epilogue; registry.NOT_YET_ON_GPU until this has run). One part, < 5 min on one H200:
#
#   run(command="bash bench/gpu_mhc_norm.sh", kind="nvidia-h200")
#
# 1. their GPU tests (real shapes vs the unfused Triton pair within rms_norm's tolerance and vs the
#    references; capture/replay; PDL contracts; the model tests with the folds on vs off);
# 2. bench/mhc_norm_site.py: µs per site, fused vs mhc_pre + rms_norm, CUDA graph of 24 sites, N 1 and 8,
#    D 2048 and 4096, bf16, with the epilogue's tile variants, and whether h is bit-identical to the pair;
# 3. the v4-mini graph step at 1 and 8 requests with the NOT_YET_ON_GPU kernels (the folds and norm_rope)
#    and without, on the same machine (kernels per step, ms per step, profile).
W=/tmp/gpu-mhc-norm  # its log folder
source "$(dirname "$0")/gpu_lib.sh"  # logged NAME TIMEOUT CMD...

logged tests 120 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_mhc_norm.py \
  tests/kernels/test_mhc_norm_model.py "tests/kernels/test_cuda_graphs.py::test_mhc_ops_replay" \
  "tests/kernels/test_kernels_pdl.py::test_each_launch_asks_pdl_launch_for_its_own_grid"
tail -n 4 $W/logs/tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/tests.txt | head -n 20 | cut -c1-300
logged site 60 python3 bench/mhc_norm_site.py --out "$OUT/mhc-norm-site-h200.json"
grep -h '"fused_us"' $W/logs/site.txt | cut -c1-300; tail -n 2 $W/logs/site.txt | cut -c1-200
logged step_not_yet 100 python3 bench/graph_decode.py --requests 1,8 --not-yet --profile \
  --out "$OUT/graph-profile-h200-mhc-norm.json"
grep -h "graph_ms" $W/logs/step_not_yet.txt | cut -c1-330; tail -n 2 $W/logs/step_not_yet.txt | cut -c1-200
logged step_base 100 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200-base.json"
grep -h "graph_ms" $W/logs/step_base.txt | cut -c1-330; tail -n 2 $W/logs/step_base.txt | cut -c1-200
cp $W/logs/*.txt "$OUT/" 2>/dev/null || true
