#!/usr/bin/env bash
# GPU steps of the twenty-first session (one H200; part a ≈ 7 min):
#
#   run(command="bash bench/gpu_session21.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session21.sh b", kind="nvidia-h200")   # ≈ 6 min
#   run(command="bash bench/gpu_session21.sh c", kind="nvidia-h200")   # ≈ 6 min (ran on an H100)
#   run(command="bash bench/gpu_session21.sh d", kind="nvidia-h100-x1")   # ≈ 6 min
#   run(command="bash bench/gpu_session21.sh e", kind="nvidia-h200")   # ≈ 6 min; written, not yet run
#
# a: dspark-tiny's table of sampled rounds (`dspark profile --engine --temperature 1`: on the static path a
#    round with a sampled request is synchronous, and gpu_session20.sh c found its drafting rounds at 2.3x a
#    plain one where the greedy table says 1.6x), then sampled "auto" planned by it (`--capacity-sampled`)
#    against plain decoding at batch 1 and 4, the batch-4 split by kind with a profile of each engine's
#    ops (what an auto plain round adds), greedy "auto" again (the static runner no longer gathers the
#    features its observer took), and the GPU tests of the static engine's DSpark rounds.
# b: after one-row observes are deferred (`StaticDraftRunner`: a plain round copies its rows into the
#    (b, T) observe's inputs, one observe per T plain rounds; the side-stream observe is gone): part a's
#    sampled and greedy runs with the shipped sampled table, greedy at batch 4 (plain rounds in flight),
#    the split with its profile, then the GPU tests of the static drafter and the plain rounds in flight.
# c: after a synchronous "auto" round drafts min(K + 1, γ) slots for its total budget K (`round._draft_width`;
#    it drafted γ): part b's runs with more repeats (greedy at batch 4 on 16 prompts: part b's cells were
#    0.5 s, a third of it prefill), and part b's GPU tests. The narrowing was reverted after this run
#    (a sampled graph per bucket and width, captured lazily: in the timed cells).
# e: the sampled table with `--auto-rounds` (each budget timed as "auto" runs it: the whole block drafted,
#    K = R·n spread by the current confidences) on this card, then sampled auto at batch 1 planned by the
#    shipped table and by it (same run), and at batch 4 by it.
# d: part c's runs on the tree without the narrowing (deferred observes only), on the same kind of GPU
#    as part c (an H100): the same-card comparison.
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack, dispatch
TABLE=bench/results/capacity-cuda-tiny-rounds-h200.json
SAMPLED=$OUT/capacity-cuda-tiny-rounds-sampled.json

tiny_auto() {  # tiny_auto NAME TIMEOUT ARGS...: bench/tiny_auto.py on CUDA (both tables) into $OUT/NAME.json
  local name=$1 limit=$2; shift 2
  logged "$name" "$limit" python3 bench/tiny_auto.py --device cuda --repeats 2 --capacity "$TABLE" \
    --capacity-sampled "$SAMPLED" "$@" --out "$OUT/$name.json"
  tail -n 14 "$W/logs/$name.txt" | cut -c1-200
}

part_a() {
  logged a_sampled_rounds 170 python3 -m dspark.cli profile --engine --model tiny --drafter dspark --device cuda \
    --requests 1,2,4 --context 192 --warmup 3 --steps 24 --temperature 1 --out "$SAMPLED"
  tail -n 20 "$W/logs/a_sampled_rounds.txt" | cut -c1-200
  [ -f "$SAMPLED" ] || return 1
  tiny_auto tiny-auto-h200-sampled 100 --budgets 0,1,3,auto --temperatures 1
  tiny_auto tiny-auto-h200-sampled-batch4 90 --prompts 8 --batch 4 --budgets 0,1,auto --temperatures 1
  logged tiny-split-b4-t1-sampled 90 python3 bench/tiny_round_split.py --device cuda --capacity "$SAMPLED" \
    --batch 4 --prompts 8 --profile --out "$OUT/tiny-split-b4-t1-sampled.json"
  tail -n 9 "$W/logs/tiny-split-b4-t1-sampled.txt" | cut -c1-200
  tiny_auto tiny-auto-h200-greedy 80 --budgets 0,5,auto --temperatures 0
  tests a_tests 150 -m gpu tests/engine/test_round_profile.py tests/engine/test_engine_static_gpu.py \
    -k "not mtp and not overlap"
}

part_b() {
  SAMPLED=bench/results/capacity-cuda-tiny-rounds-sampled-h200.json
  tiny_auto tiny-auto-h200-deferred 100 --budgets 0,1,3,auto --temperatures 1
  tiny_auto tiny-auto-h200-deferred-batch4 90 --prompts 8 --batch 4 --budgets 0,1,auto --temperatures 1
  logged tiny-split-b4-t1-deferred 90 python3 bench/tiny_round_split.py --device cuda --capacity "$SAMPLED" \
    --batch 4 --prompts 8 --profile --out "$OUT/tiny-split-b4-t1-deferred.json"
  tail -n 9 "$W/logs/tiny-split-b4-t1-deferred.txt" | cut -c1-200
  tiny_auto tiny-auto-h200-deferred-greedy 80 --budgets 0,5,auto --temperatures 0
  tiny_auto tiny-auto-h200-deferred-greedy-batch4 80 --prompts 8 --batch 4 --budgets 0,5,auto --temperatures 0
  tests b_tests 200 -m gpu tests/engine/test_engine_draft_lookahead_plain.py tests/draft/test_static_draft_graph_gpu.py \
    tests/engine/test_engine_static_gpu.py -k "not mtp and not overlap"
}

longer() {  # longer PREFIX: part b's tiny_auto runs with more repeats, then the GPU tests
  SAMPLED=bench/results/capacity-cuda-tiny-rounds-sampled-h200.json
  tiny_auto "$1" 110 --budgets 0,1,3,auto --temperatures 1 --repeats 3
  tiny_auto "$1-batch4" 100 --prompts 8 --batch 4 --budgets 0,1,auto --temperatures 1 --repeats 3
  tiny_auto "$1-greedy" 80 --budgets 0,5,auto --temperatures 0 --repeats 3
  tiny_auto "$1-greedy-batch4" 90 --prompts 16 --batch 4 --budgets 0,5,auto --temperatures 0 --repeats 3
  tests "$1_tests" 200 -m gpu tests/engine/test_engine_draft_lookahead_plain.py tests/draft/test_static_draft_graph_gpu.py \
    tests/engine/test_engine_static_gpu.py -k "not mtp and not overlap"
}

part_c() { longer tiny-auto-h200-narrow; }

part_e() {
  local table=$OUT/capacity-cuda-tiny-auto-rounds-sampled.json
  logged e_auto_rounds 200 python3 -m dspark.cli profile --engine --auto-rounds --model tiny --drafter dspark \
    --device cuda --requests 1,2,4 --context 192 --warmup 3 --steps 24 --temperature 1 --out "$table"
  tail -n 20 "$W/logs/e_auto_rounds.txt" | cut -c1-200
  [ -f "$table" ] || return 1
  SAMPLED=bench/results/capacity-cuda-tiny-rounds-sampled-h200.json  # the shipped table, same run: the baseline
  tiny_auto tiny-auto-s21e-shipped 110 --budgets 0,3,auto --temperatures 1 --repeats 3
  SAMPLED=$table
  tiny_auto tiny-auto-s21e 110 --budgets 0,3,auto --temperatures 1 --repeats 3
  tiny_auto tiny-auto-s21e-batch4 100 --prompts 8 --batch 4 --budgets 0,1,auto --temperatures 1 --repeats 3
}
part_d() { longer tiny-auto-s21d; }

dispatch session21 "${1:-}"
