#!/usr/bin/env bash
# GPU steps of the thirty-first session, for one H100 or H200 (every JSON names its card):
#
#   run(command="SKIP_TESTS=1 bash bench/gpu_session32.sh a")   # ≈ 3 min; ran (H100): moe-split-ab-*-h100-s31.json
#   (the tests: 37 passed on an H100 in an earlier call, gpu-tests-moe-split-h100-s31.log)
#
# a: the decode MoE's down kernel with its expert slots (the shared expert and the K routed ones) split
#    over several programs per row block (`DecodeTiles.down_split`: fp32 parts, the last program to
#    take its ticket adds them in a fixed order), where one program walked all K + 1 experts' rows in
#    turn: the MoE GPU tests of the decode path, then `bench/moe_decode_tiles.py --split-ab`: the
#    shipped shapes against themselves split 2 / 4 ways (and 7 at 8 tokens), at their row block and 2
#    and 4 times it; the down kernel alone and the whole op, each a CUDA graph of 12 calls over several
#    weight sets, the variants in turn over 3 rounds. The V4-Flash layer with FP8 128×128 and 32×32
#    experts at one token and 32×32 at 8 (issue 6's FP8 rows under 60 % of HBM), then v4-mini's bf16
#    (its graph step's) and FP8 128×128 experts at one token.
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch

split_ab() {  # split_ab NAME TIMEOUT ARGS...: moe_decode_tiles.py --split-ab into $OUT/moe-split-ab-NAME.json
  local name=$1 limit=$2; shift 2
  logged "a_split_$name" "$limit" python3 bench/moe_decode_tiles.py --split-ab --out "$OUT/moe-split-ab-$name.json" "$@"
  grep -h "shipped .* best" "$W/logs/a_split_$name.txt"; tail -n 2 "$W/logs/a_split_$name.txt" | cut -c1-300
}

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  [ -n "${SKIP_TESTS:-}" ] || tests a_tests 120 tests/kernels/test_moe.py -k "decode or split"
  split_ab flash-m1 130 --layers v4-flash --kinds fp8,fp8-32 --tokens 1 --splits 2,4
  split_ab flash-m8 80 --layers v4-flash --kinds fp8-32 --tokens 8 --splits 2,4,7
  split_ab mini-m1 90 --layers v4-mini --kinds bf16,fp8 --tokens 1 --splits 2,4
}

dispatch session32 "${1:-}"
