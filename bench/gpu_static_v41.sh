#!/usr/bin/env bash
# The GPU steps of the V4.1 static decode step (issue 7), one H200, < 8 min in all:
#
#   run(command="bash bench/gpu_static_v41.sh", kind="nvidia-h200")
#
# 1. tests/models_v41/test_deepseek_v41_static_graph_gpu.py (tiny-v41, Triton kernels): the eager
#    static step runs under torch.cuda.set_sync_debug_mode("error"), StepGraph replays (T = 1, 4)
#    equal it bit for bit, both follow the dynamic path -> $OUT/static-v41-gpu-test.{txt,xml}
# 2. bench/graph_decode.py --config v41-mini (bf16, context 4096, B = 1, 8, 64): dynamic vs static
#    eager vs graph replay step times and logit differences -> $OUT/graph-decode-v41-mini.json
set -uo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 180 python -m pytest -q -p no:cacheprovider tests/models_v41/test_deepseek_v41_static_graph_gpu.py \
  --junitxml="$OUT/static-v41-gpu-test.xml" > "$OUT/static-v41-gpu-test.txt" 2>&1
echo "gpu test rc=$?" | tee -a "$OUT/static-v41-gpu-test.txt"
tail -3 "$OUT/static-v41-gpu-test.txt"
timeout 360 python bench/graph_decode.py --config v41-mini --out "$OUT/graph-decode-v41-mini.json" \
  2>&1 | tee "$OUT/graph-decode-v41-mini.log"
echo "bench rc=${PIPESTATUS[0]}"
