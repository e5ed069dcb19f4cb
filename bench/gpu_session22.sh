#!/usr/bin/env bash
# GPU steps of the twenty-second session (one H200 or H100; each part under the 10-minute call limit):
#
#   run(command="bash bench/gpu_session22.sh a")   # ≈ 4 min
#   run(command="bash bench/gpu_session21.sh e")   # ≈ 8 min: the auto-rounds table (written last session)
#
# a: the decode MoE's down kernel with one expert per program and no third launch
#    (`DecodeTiles.down_split`: the last program of a row block to arrive adds the partials, counted by an
#    atomic counter that the up kernel zeroes; each program's K loop pipelined alone with `stages`): its GPU
#    tests, then the one-token sweep of V4-Flash FP8 128×128 and 32×32 with split and unsplit down shapes
#    and the whole op at the shipped, best and best split shapes in one run. Session 16's split (a third
#    launch adding the partials, no per-expert pipelining) lost 69.5 -> 75.9 µs.
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch

part_a() {
  tests a_moe_tests 150 tests/kernels/test_moe.py -k "decode"
  logged a_split 420 python3 bench/moe_decode_tiles.py --layers v4-flash --kinds fp8,fp8-32 --tokens 1 --graph \
    --rows 8,16,32 --fp8-steps 512,1024,2048 --stages 1,3 --split 0,1 --out "$OUT/moe-decode-tiles-split2-h200.json"
  tail -n 4 "$W/logs/a_split.txt" | cut -c1-900
}

dispatch session22 "${1:-}"
