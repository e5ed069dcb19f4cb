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

part_a() {
  tests a_tests 120 tests/engine/test_round_profile.py
  logged a_rounds 150 python3 -m dspark.cli profile --engine --model tiny --drafter dspark --device cuda \
    --requests 1,2,4 --context 192 --warmup 4 --steps 16 --out "$OUT/capacity-cuda-tiny-rounds.json"
  tail -n 30 $W/logs/a_rounds.txt | cut -c1-200
  logged a_auto 120 python3 bench/tiny_auto.py --device cuda --capacity "$OUT/capacity-cuda-tiny-rounds.json" \
    --repeats 2 --out "$OUT/tiny-auto-h200.json"
  logged a_auto_b4 120 python3 bench/tiny_auto.py --device cuda --capacity "$OUT/capacity-cuda-tiny-rounds.json" \
    --prompts 8 --batch 4 --repeats 2 --budgets 0,1,3,5,auto --out "$OUT/tiny-auto-h200-batch4.json"
  logged a_auto_eager 90 python3 bench/tiny_auto.py --device cuda --repeats 2 --budgets 0,1,3,5,auto \
    --capacity bench/results/capacity-cuda-tiny-eager-h200.json --out "$OUT/tiny-auto-h200-eager-table.json"
  tail -n 40 $W/logs/a_auto.txt | cut -c1-200; tail -n 22 $W/logs/a_auto_b4.txt $W/logs/a_auto_eager.txt | cut -c1-200
}

part_b() {  # part a's first two steps only, for a short lease
  tests b_tests 120 tests/engine/test_round_profile.py
  logged b_rounds 120 python3 -m dspark.cli profile --engine --model tiny --drafter dspark --device cuda \
    --requests 1,2,4 --context 192 --warmup 3 --steps 12 --out "$OUT/capacity-cuda-tiny-rounds.json"
  tail -n 20 $W/logs/b_rounds.txt | cut -c1-200
  logged b_auto 120 python3 bench/tiny_auto.py --device cuda --capacity "$OUT/capacity-cuda-tiny-rounds.json" \
    --repeats 2 --out "$OUT/tiny-auto-h200.json"
  tail -n 30 $W/logs/b_auto.txt | cut -c1-200
}

part_c() {  # the engine-round table alone
  logged c_rounds 140 python3 -m dspark.cli profile --engine --model tiny --drafter dspark --device cuda \
    --requests 1,2,4 --context 192 --warmup 3 --steps 12 --out "$OUT/capacity-cuda-tiny-rounds.json"
  tail -n 20 $W/logs/c_rounds.txt | cut -c1-200
}

dispatch session19 "${1:-}"
