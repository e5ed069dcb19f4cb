#!/usr/bin/env bash
# GPU steps of the tenth session, 2026-12-01 (each part < 9.5 min on one H200):
#
#   run(command="bash bench/gpu_session10.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session10.sh c")
#
# a: the ninth session's CPU-only ops (`hc_head_norm`: V4's output collapse + final RMSNorm in two
#    launches; `index_scores_pooled`: V4.1's pool block maxima in the indexer score kernel), both in
#    NOT_YET_ON_GPU, under their GPU tests; the v4-mini and v41-mini steps with them (--not-yet) and
#    without; where a DSpark round's time goes at one request: the drafter's propose and observe graphs
#    (bench/graph_draft.py --profile, PDL off for per-kernel attribution) and the target's 4-token
#    verify step (bench/graph_decode.py --tokens 4 --profile --no-pdl); the one-row GEMV against cuBLAS
#    with the weight prefetch (bench/linear_decode.py).
# c: the engine over the issue's whole load grid: 1 / 8 / 16 / 32 / 64 / 128 / 256 requests x no
#    speculation, MTP-1, DSpark budgets 1-3 and auto (round in flight), graphs + overlap, a constant
#    drafter confidence 0.8629 (budget 3 -> 3.25 tokens per round, the seeds' conversion), the auto
#    cells planning on the fixed cells' step times, at 4K (with HF transformers eager at batch 1) and 32K.
#
# Only 8 files come back from a call, so every part ends by packing $OUT into one session10-PART.tgz.
set -uo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
W=/tmp/gpu-session && mkdir -p $W/logs

source "$(dirname "$0")/gpu_lib.sh"  # logged NAME TIMEOUT CMD...

step() {  # step NAME TIMEOUT ARGS...: bench/graph_decode.py into $OUT/NAME.json, its graph_ms lines shown
  local name=$1 limit=$2; shift 2
  logged "$name" "$limit" python3 bench/graph_decode.py "$@" --out "$OUT/$name.json"
  grep -h "graph_ms\|\"profile\"\|torch_ops" "$W/logs/$name.txt" | cut -c1-900; tail -n 2 "$W/logs/$name.txt" | cut -c1-200
}

tests() {  # tests NAME TIMEOUT PYTEST-ARGS...: pytest quietly, its summary and failures shown
  local name=$1 limit=$2; shift 2
  logged "$name" "$limit" python3 -m pytest -q -p no:cacheprovider -rs "$@"
  tail -n 3 "$W/logs/$name.txt" | cut -c1-400; grep -h "^E  \|FAILED" "$W/logs/$name.txt" | head -n 12 | cut -c1-300
}

part_a() {
  tests a_tests 170 tests/kernels/test_hc_head_norm.py tests/kernels/test_hc_head_norm_model.py \
    "tests/kernels/test_cuda_graphs.py::test_mhc_ops_replay" tests/kernels/test_indexer_pool_fused.py \
    tests/kernels/test_indexer_pool.py tests/kernels/test_lightning_indexer.py
  step graph-decode-h200-s10-hc-head 55 --requests 1,8 --not-yet
  step graph-decode-h200-s10-base 55 --requests 1,8
  step graph-decode-v41-mini-h200-s10-pooled 60 --config v41-mini --requests 1,8 --not-yet
  step graph-decode-v41-mini-h200-s10-base 60 --config v41-mini --requests 1,8
  logged a_draft 80 python3 bench/graph_draft.py --requests 1 --profile --no-pdl --out "$OUT/graph-draft-h200-s10-profile.json"
  grep -h "^{" $W/logs/a_draft.txt | cut -c1-1200; tail -n 2 $W/logs/a_draft.txt | cut -c1-200
  step graph-verify-h200-s10-profile 55 --requests 1 --tokens 4 --profile --no-pdl
  logged a_linear 70 python3 bench/linear_decode.py --no-sweep --out "$OUT/linear-decode-h200-s10.json"
  tail -n 25 $W/logs/a_linear.txt | cut -c1-250
}

part_c() {
  local grid=(--static-decode --overlap --requests 1,8,16,32,64,128,256 --modes none,mtp1,dspark1,dspark2,dspark3,auto_async
              --decode-only --steps 8 --confidence 0.8629 --table-from-cells)
  logged c_engine_4k 330 python3 bench/engine_h200.py "${grid[@]}" --contexts 4096 --budget-s 280 --peer \
    --out "$OUT/engine-h200-s10.json"
  tail -n 40 $W/logs/c_engine_4k.txt | cut -c1-300
  logged c_engine_32k 250 python3 bench/engine_h200.py "${grid[@]}" --contexts 32768 --budget-s 210 \
    --out "$OUT/engine-h200-s10-32k.json"
  tail -n 30 $W/logs/c_engine_32k.txt | cut -c1-300
}

case "${1:?part: a or c}" in
  a) part_a ;;
  c) part_c ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
cp $W/logs/*.txt "$OUT/" 2>/dev/null || true
(cd "$OUT" && tar czf "/tmp/session10-$1.tgz" . && find . -type f -delete && mv "/tmp/session10-$1.tgz" .)
