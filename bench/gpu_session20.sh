#!/usr/bin/env bash
# GPU steps of the twentieth session (one H200; part a ≈ 4 min):
#
#   run(command="bash bench/gpu_session20.sh a", kind="nvidia-h200")
#
# a: where dspark-tiny's sampled "auto" loses to plain decoding on the GPU (gpu_session19.sh a: T = 1
#    auto / plain 0.88 at batch 1, 0.75 at batch 4): `bench/tiny_round_split.py` times every engine step
#    by kind (prefill, plain round, drafting round) for budget 0 and "auto" with the engine-round table,
#    with the drafter's observe as the engine runs it and replayed on the side stream (`--observe aside`).
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack, dispatch
TABLE=bench/results/capacity-cuda-tiny-rounds-h200.json

split() {  # split NAME TIMEOUT ARGS...: bench/tiny_round_split.py on CUDA into $OUT/NAME.json
  local name=$1 limit=$2; shift 2
  logged "$name" "$limit" python3 bench/tiny_round_split.py --device cuda --capacity "$TABLE" "$@" \
    --out "$OUT/$name.json"
  tail -n 7 "$W/logs/$name.txt" | cut -c1-200
}

part_a() {
  split tiny-split-b4-t1 90 --batch 4 --prompts 8
  split tiny-split-b4-t1-aside 90 --batch 4 --prompts 8 --observe aside
  split tiny-split-b1-t1 90 --batch 1 --prompts 4
  split tiny-split-b1-t1-aside 90 --batch 1 --prompts 4 --observe aside
  split tiny-split-b4-t0 90 --batch 4 --prompts 8 --temperature 0
}

dispatch session20 "${1:-}"
