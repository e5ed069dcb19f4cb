#!/usr/bin/env bash
# GPU steps of the twentieth session (one H200; part a ≈ 4 min):
#
#   run(command="bash bench/gpu_session20.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session20.sh b", kind="nvidia-h200")   # ≈ 4 min; run instead of a
#   run(command="bash bench/gpu_session20.sh c", kind="nvidia-h200")   # ≈ 2.5 min: b, fewer cells
#
# a: where dspark-tiny's sampled "auto" loses to plain decoding on the GPU (gpu_session19.sh a: T = 1
#    auto / plain 0.88 at batch 1, 0.75 at batch 4): `bench/tiny_round_split.py` times every engine step
#    by kind (prefill, plain round, drafting round) for budget 0 and "auto" with the engine-round table,
#    with the drafter's observe as the engine runs it and replayed on the side stream (`--observe aside`).
# b: gpu_session19.sh a's runs again after `bench/tiny_auto.py` warms each engine with a whole batch per
#    temperature at full length (19 a warmed with 16 greedy tokens of one request: its first cells and its
#    sampled auto cells timed graph captures and Triton compiles), then part a's batch-4 split.
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

tiny_auto() {  # tiny_auto NAME TIMEOUT ARGS...: bench/tiny_auto.py on CUDA into $OUT/NAME.json
  local name=$1 limit=$2; shift 2
  logged "$name" "$limit" python3 bench/tiny_auto.py --device cuda --repeats 2 --capacity "$TABLE" "$@" \
    --out "$OUT/$name.json"
  tail -n 24 "$W/logs/$name.txt" | cut -c1-200
}

part_b() {
  tiny_auto tiny-auto-h200-warm 120 --budgets 0,1,2,3,4,5,auto
  tiny_auto tiny-auto-h200-warm-batch4 120 --prompts 8 --batch 4 --budgets 0,1,3,5,auto
  split tiny-split-b4-t1 90 --batch 4 --prompts 8
  split tiny-split-b4-t1-aside 90 --batch 4 --prompts 8 --observe aside
}

part_c() {  # part b in fewer cells, for a short lease
  tiny_auto tiny-auto-h200-warm 90 --budgets 0,3,5,auto
  tiny_auto tiny-auto-h200-warm-batch4 60 --prompts 8 --batch 4 --budgets 0,5,auto --temperatures 1
  split tiny-split-b4-t1 60 --batch 4 --prompts 8
  split tiny-split-b4-t1-aside 60 --batch 4 --prompts 8 --observe aside
}

dispatch session20 "${1:-}"
