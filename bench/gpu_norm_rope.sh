#!/usr/bin/env bash
# GPU steps of the norm_rope op (RMSNorm + RoPE of attention's q heads / kv latents in one launch, the
# kv rows stored at their window-ring rows by the kernel in the V4 static step). One part, < 8 min:
#
#   run(command="bash bench/gpu_norm_rope.sh", kind="nvidia-h200")
#
# 1. its GPU tests (bit for bit against the fused rms_norm -> rope pair at v4-mini shapes, within
#    rms_norm's tolerance of the references, capture/replay, PDL contracts, the static step with it);
# 2. the v4-mini graph step at 1 and 8 requests with the NOT_YET_ON_GPU kernels (norm_rope) and without,
#    on the same machine (an A/B: kernels per step and ms per step, with the profile).
set -uo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
W=/tmp/gpu-norm-rope && mkdir -p $W/logs

source "$(dirname "$0")/gpu_lib.sh"  # logged NAME TIMEOUT CMD...

logged tests 200 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_norm_rope.py \
  "tests/kernels/test_cuda_graphs.py::test_norm_and_rope_replay" tests/kernels/test_kernels_pdl.py \
  tests/kernels/test_static_step_kernels.py tests/models/test_deepseek_v4_static_graph_gpu.py
tail -n 4 $W/logs/tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/tests.txt | head -n 20 | cut -c1-300
logged step_not_yet 110 python3 bench/graph_decode.py --requests 1,8 --not-yet --profile \
  --out "$OUT/graph-profile-h200-norm-rope.json"
grep -h "graph_ms" $W/logs/step_not_yet.txt | cut -c1-330; tail -n 2 $W/logs/step_not_yet.txt | cut -c1-200
logged step_base 110 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200-base.json"
grep -h "graph_ms" $W/logs/step_base.txt | cut -c1-330; tail -n 2 $W/logs/step_base.txt | cut -c1-200
cp $W/logs/*.txt "$OUT/" 2>/dev/null || true
