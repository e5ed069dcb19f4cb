#!/usr/bin/env bash
# GPU steps prepared in the sixteenth session for the next one (not yet run; each part < 9.5 min on one H200):
#
#   run(command="bash bench/gpu_session18.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session18.sh b", kind="nvidia-h200")
#   run(command="bash bench/gpu_session18.sh c", kind="nvidia-h200")
#
# a: the decode MoE's deferred column sums with their K loops pipelined (`DecodeTiles(stages=2|3,
#    up_defer=True, down_defer=True)`: with no cross-thread sum per step, Triton streams the weight
#    tiles through shared memory ahead of their use, LDGSTS in the sm_90 build). The sixteenth session's
#    Nsight Compute rows put the one-token FP8 kernels at 25-39 % occupancy and half-idle issue slots
#    (latency-bound); deferred sums alone and the pipelined per-step sums each lost. Its GPU tests, the
#    V4-Flash FP8 sweep at one token (`shipped`: the table's shapes), then the 32x32 8-token layer that
#    part c of gpu_session17.sh did not reach.
# b: `python bench/slot_buckets_h200.py` (written in the fifth session, never run): one 64-slot static
#    engine at 64 ... 1 live requests.
# c: dspark-tiny on the GPU (written in the seventeenth session): `dspark profile --drafter dspark` on CUDA
#    (a table that prices drafting rounds; candidate for the drafter's capacity-cuda.json), then
#    `bench/tiny_auto.py --device cuda` with that table and with the synthetic default: auto against
#    budgets 0..5 at batch 1 and 4 (the graph path's round in flight, greedy; sampled rounds synchronous).
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack, dispatch

part_a() {
  tests a_tests 150 tests/kernels/test_moe.py -k "decode"
  logged a_defer_stages 300 python3 bench/moe_decode_tiles.py --layers v4-flash --kinds fp8,fp8-32 --tokens 1 --graph \
    --rows 8,16 --fp8-steps 256,512,1024 --defer 1 --stages 2,3 --out "$OUT/moe-decode-tiles-defer-stages-h200.json"
  grep -h "shipped" $W/logs/a_defer_stages.txt | cut -c1-900
  logged a_defer_32_eight 150 python3 bench/moe_decode_tiles.py --layers v4-flash --kinds fp8-32 --tokens 8 --graph \
    --rows 16,32 --fp8-steps 256,512,1024 --defer 1 --out "$OUT/moe-decode-tiles-defer-fp8-32-m8-h200.json"
  grep -h "shipped" $W/logs/a_defer_32_eight.txt | cut -c1-900
}

part_b() {
  logged b_buckets 400 python3 bench/slot_buckets_h200.py --out "$OUT/slot-buckets-h200.json"
  tail -n 20 $W/logs/b_buckets.txt | cut -c1-300
}

part_c() {
  logged c_profile 150 python3 -m dspark.cli profile --model tiny --drafter dspark --device cuda --width 6 \
    --context 192 --batch-tokens 1,2,3,4,5,6,12,18,24,36,48 --repeats 15 --warmup 3 --out "$OUT/capacity-cuda-tiny.json"
  logged c_auto 200 python3 bench/tiny_auto.py --device cuda --capacity "$OUT/capacity-cuda-tiny.json" \
    --out "$OUT/tiny-auto-h200.json"
  logged c_auto_b4 150 python3 bench/tiny_auto.py --device cuda --capacity "$OUT/capacity-cuda-tiny.json" \
    --prompts 8 --batch 4 --budgets 0,1,3,5,auto --out "$OUT/tiny-auto-h200-batch4.json"
  tail -n 12 $W/logs/c_auto.txt $W/logs/c_auto_b4.txt | cut -c1-200
}

dispatch session18 "${1:-}"
