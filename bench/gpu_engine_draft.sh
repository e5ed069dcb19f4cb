#!/usr/bin/env bash
# The GPU steps of the engine's static DSpark drafting (issue 7), one H200, < 8 min in all:
#
#   run(command="bash bench/gpu_engine_draft.sh", kind="nvidia-h200")
#
# 1. tests/engine/test_engine_static_gpu.py (tiny-v4, fp32, Triton kernels): static_decode engine with
#    DSpark (budget 3 and auto) replays the target's and the static drafter's CUDA graphs (dynamic
#    propose forbidden) and equals the default engine's greedy tokens; a mixed sampled/greedy batch
#    runs on the eager static propose and frees its slots; plus tests/draft/test_static_draft_graph_gpu.py
#    -> $OUT/engine-draft-gpu-test.{txt,xml}
# 2. bench/engine_h200.py --static-decode on v4-mini (bf16), grid trimmed to a 300 s budget: decode
#    step times with the static drafter in the DSpark cells (rows: static_drafter, draft_graphs)
#    -> $OUT/engine-h200-static.json (+ .log)
set -uo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 130 python -m pytest -q -p no:cacheprovider tests/engine/test_engine_static_gpu.py \
  tests/draft/test_static_draft_graph_gpu.py --junitxml="$OUT/engine-draft-gpu-test.xml" \
  > "$OUT/engine-draft-gpu-test.txt" 2>&1
echo "gpu test rc=$?" | tee -a "$OUT/engine-draft-gpu-test.txt"
tail -3 "$OUT/engine-draft-gpu-test.txt"
timeout 330 python bench/engine_h200.py --static-decode --budget-s 300 --out "$OUT/engine-h200-static.json" \
  2>&1 | tee "$OUT/engine-h200-static.log"
echo "bench rc=${PIPESTATUS[0]}"
