#!/usr/bin/env bash
# GPU steps of the twenty-second session (one H200 or H100; each part under the 10-minute call limit):
#
#   run(command="bash bench/gpu_session22.sh a")   # ≈ 4 min
#   run(command="bash bench/gpu_session21.sh e")   # ≈ 2 min: the auto-rounds table (ran on an H100)
#   run(command="bash bench/gpu_session22.sh b")   # ≈ 3 min (ran on an H100)
#   run(command="bash bench/gpu_session22.sh c")   # ≈ 4 min on an H200; on another card it stops at once
#   run(command="bash bench/gpu_session22.sh d")   # ≈ 4 min, then part c on an H200
#   run(command="bash bench/gpu_session22.sh e")   # ≈ 2 min
#
# a: the decode MoE's down kernel with one expert per program and no third launch
#    (`DecodeTiles.down_split`: the last program of a row block to arrive adds the partials, counted by an
#    atomic counter that the up kernel zeroes; each program's K loop pipelined alone with `stages`): its GPU
#    tests, then the one-token sweep of V4-Flash FP8 128×128 and 32×32 with split and unsplit down shapes
#    and the whole op at the shipped, best and best split shapes in one run. Session 16's split (a third
#    launch adding the partials, no per-expert pipelining) lost 69.5 -> 75.9 µs. Ran on an H100 at 29a4825;
#    the split lost again and was reverted, so part a needs that commit to run again.
# b: dspark-tiny's tables for the card it lands on. On an H100 (where session 21 part e wrote the sampled
#    table with --auto-rounds, 0.765 -> 1.012 of plain decoding at batch 1 against the H200's table): the
#    greedy table both ways (fixed-budget engines as the shipped H200 one, and --auto-rounds), greedy
#    "auto" by each at batch 1 and 4 (A/B in one run), sampled by part e's table at batch 4 again. On
#    an H200: the sampled table with --auto-rounds, sampled "auto" by it and by the shipped one (A/B).
# c: part b's H200 branch only (the A/B of the sampled table with --auto-rounds against the shipped one).
# d: the decode MoE's down kernel with the experts in its inner loop (`DecodeTiles.down_interleave`: each
#    K step loads the tiles of all K + 1 experts, independent loads in flight together, as the up kernel's
#    gate and up tiles; the shipped kernel walks one expert's row after another): its GPU tests, the
#    one-token V4-Flash FP8 sweep with and without it (the whole op at the shipped and best shapes in the
#    same run), then part c where the card is an H200.
# e: the decode MoE's kernels overlapped (`DecodeTiles.up_pdl`: the up kernel launched with PDL whatever its
#    grid, so the down kernel is scheduled as its last wave retires; `down_prefetch`: the down programs ask
#    L2 for their weight rows before their PDL wait): the GPU tests of the decode MoE and of PDL, then
#    `bench/moe_decode_overlap.py` (the fused MoE with its router at one token, shipped vs variants).
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch

part_a() {
  tests a_moe_tests 150 tests/kernels/test_moe.py -k "decode"
  logged a_split 420 python3 bench/moe_decode_tiles.py --layers v4-flash --kinds fp8,fp8-32 --tokens 1 --graph \
    --rows 8,16,32 --fp8-steps 512,1024,2048 --stages 1,3 --split 0,1 --out "$OUT/moe-decode-tiles-split2.json"
  tail -n 4 "$W/logs/a_split.txt" | cut -c1-900
}

tiny() {  # tiny NAME GREEDY SAMPLED ARGS...: bench/tiny_auto.py on CUDA by these tables into $OUT/NAME.json
  local name=$1 greedy=$2 sampled=$3; shift 3
  logged "$name" 120 python3 bench/tiny_auto.py --device cuda --repeats 3 --capacity "$greedy" \
    --capacity-sampled "$sampled" "$@" --out "$OUT/$name.json"
  grep -h "n=auto\|auto_over_best" "$W/logs/$name.txt" | cut -c1-200
}

rounds() {  # rounds NAME ARGS...: dspark-tiny's engine-round table on this card into $OUT/NAME.json
  local name=$1; shift
  logged "$name" 200 python3 -m dspark.cli profile --engine --model tiny --drafter dspark --device cuda \
    --requests 1,2,4 --context 192 --warmup 3 --steps 24 "$@" --out "$OUT/$name.json"
  tail -n 3 "$W/logs/$name.txt" | cut -c1-200
}

part_b() {
  local card; card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1); echo "card: $card"
  if [[ $card == *H100* && ${1:-} != h200 ]]; then
    local sampled=bench/results/capacity-cuda-tiny-auto-rounds-sampled-h100.json
    rounds capacity-cuda-tiny-rounds-h100
    rounds capacity-cuda-tiny-auto-rounds-h100 --auto-rounds
    for t in rounds auto-rounds; do
      tiny "tiny-auto-h100-greedy-$t" "$OUT/capacity-cuda-tiny-$t-h100.json" "$sampled" --budgets 0,5,auto --temperatures 0
      tiny "tiny-auto-h100-greedy-$t-batch4" "$OUT/capacity-cuda-tiny-$t-h100.json" "$sampled" --prompts 16 --batch 4 \
        --budgets 0,5,auto --temperatures 0
    done
    tiny tiny-auto-h100-sampled-batch4 "$OUT/capacity-cuda-tiny-rounds-h100.json" "$sampled" --prompts 8 --batch 4 \
      --budgets 0,1,auto --temperatures 1
  else
    local shipped=bench/results/capacity-cuda-tiny-rounds-sampled-h200.json greedy=bench/results/capacity-cuda-tiny-rounds-h200.json
    rounds capacity-cuda-tiny-auto-rounds-sampled-h200 --auto-rounds --temperature 1
    tiny tiny-auto-h200-sampled-shipped "$greedy" "$shipped" --budgets 0,3,auto --temperatures 1
    tiny tiny-auto-h200-sampled-auto-rounds "$greedy" "$OUT/capacity-cuda-tiny-auto-rounds-sampled-h200.json" \
      --budgets 0,3,auto --temperatures 1
    tiny tiny-auto-h200-sampled-auto-rounds-batch4 "$greedy" "$OUT/capacity-cuda-tiny-auto-rounds-sampled-h200.json" \
      --prompts 8 --batch 4 --budgets 0,1,auto --temperatures 1
  fi
}

part_c() {
  local card; card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
  [[ $card == *H200* ]] || { echo "card: $card, not an H200: part c stops"; return 0; }
  part_b h200
}

part_d() {
  tests d_moe_tests 150 tests/kernels/test_moe.py -k "decode"
  logged d_interleave 240 python3 bench/moe_decode_tiles.py --layers v4-flash --kinds fp8,fp8-32 --tokens 1 --graph \
    --rows 4,8,16 --fp8-steps 256,512,1024 --interleave 0,1 --out "$OUT/moe-decode-tiles-interleave.json"  # ran at c259308 (H100), reverted
  tail -n 3 "$W/logs/d_interleave.txt" | cut -c1-900
  part_c
}

part_e() {
  tests e_tests 150 tests/kernels/test_moe.py tests/kernels/test_kernels_pdl.py -k "decode or pdl or overlap"
  logged e_overlap 200 python3 bench/moe_decode_overlap.py --out "$OUT/moe-decode-overlap.json"  # ran at 0989ca9 (H100), reverted
  grep -h " us (" "$W/logs/e_overlap.txt" | cut -c1-200; tail -n 2 "$W/logs/e_overlap.txt" | cut -c1-300
}

dispatch session22 "${1:-}"
