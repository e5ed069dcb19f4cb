#!/usr/bin/env bash
# GPU steps of the nineteenth session (one H200; part a < 8 min):
#
#   run(command="bash bench/gpu_session19.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session19.sh b", kind="nvidia-h200")   # or b alone: a's first two steps
#   run(command="bash bench/gpu_session19.sh c", kind="nvidia-h200")   # or c alone: a's first step
#
# a: dspark-tiny's capacity priced by the engine's own rounds on CUDA (`dspark profile --engine`: an
#    engine per load R and fixed budget n, graphs and the round in flight included; the eager
#    `dspark profile` of part c of gpu_session18.sh timed 15-18 ms per forward where a graph round is a
#    few ms), then `bench/tiny_auto.py --device cuda` (one engine per budget, built and warmed before any
#    timing: the eighteenth session's run timed each `generate`'s graph capture) with that table at
#    batch 1 and 4 (tiny's loads), and at batch 1 with the eager table for comparison.
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack, dispatch

rounds_table() {  # rounds_table PART STEPS: the GPU tests, then dspark-tiny's engine-round table on CUDA
  tests "$1_tests" 120 tests/engine/test_round_profile.py
  logged "$1_rounds" 150 python3 -m dspark.cli profile --engine --model tiny --drafter dspark --device cuda \
    --requests 1,2,4 --context 192 --warmup 3 --steps "$2" --out "$OUT/capacity-cuda-tiny-rounds.json"
  tail -n 20 "$W/logs/$1_rounds.txt" | cut -c1-200
}

tiny_auto() {  # tiny_auto NAME TIMEOUT ARGS...: bench/tiny_auto.py on CUDA into $OUT/NAME.json
  local name=$1 limit=$2; shift 2
  logged "$name" "$limit" python3 bench/tiny_auto.py --device cuda --repeats 2 "$@" --out "$OUT/$name.json"
  tail -n 24 "$W/logs/$name.txt" | cut -c1-200
}

part_a() {
  rounds_table a 16
  tiny_auto tiny-auto-h200 120 --capacity "$OUT/capacity-cuda-tiny-rounds.json"
  tiny_auto tiny-auto-h200-batch4 120 --capacity "$OUT/capacity-cuda-tiny-rounds.json" \
    --prompts 8 --batch 4 --budgets 0,1,3,5,auto
  tiny_auto tiny-auto-h200-eager-table 90 --capacity bench/results/capacity-cuda-tiny-eager-h200.json \
    --budgets 0,1,3,5,auto
}

part_b() {  # part a's first two steps only, for a short lease
  rounds_table b 12
  tiny_auto tiny-auto-h200 120 --capacity "$OUT/capacity-cuda-tiny-rounds.json"
}

part_c() {  # the engine-round table alone
  rounds_table c 12
}

dispatch session19 "${1:-}"
