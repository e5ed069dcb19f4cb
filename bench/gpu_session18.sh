#!/usr/bin/env bash
# GPU steps prepared in the sixteenth session for the next one (not yet run; each part < 9.5 min on one H200):
#
#   run(command="bash bench/gpu_session18.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session18.sh b", kind="nvidia-h200")
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

dispatch session18 "${1:-}"
