#!/usr/bin/env bash
# GPU steps of the thirty-seventh session, for one H200 (an H100 runs them too; every JSON names its card).
# Part a ran in that session on an H100 (bench/README.md); DecodeTiles.up_stages was then taken out: run it
# at commit 6e0eb51.
#
#   run(command="bash bench/gpu_session40.sh a")   # ≈ 3 min
#
# a: the gate/up kernel pipelined apart from the down kernel (`DecodeTiles.up_stages`; the one-token H200
#    sweep found 3 stages 43.8 -> 41.7 µs for that kernel alone): its GPU tests, then the decode op at the
#    shipped shapes against up_stages 2 and 3 (`bench/moe_decode_tiles.py --split-ab --up-stages 2,3`).
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, pack, dispatch

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests a_tests 60 --tb=line tests/kernels/test_moe.py -k "stages"
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  logged a_ab 300 python3 bench/moe_decode_tiles.py --split-ab --layers v4-flash --kinds fp8,fp8-32 \
    --tokens 1,8 --up-stages 2,3 --out "$OUT/moe-up-stages-ab-flash-$(card)-s37.json"
  grep -h "up_stages=" "$W/logs/a_ab.txt" | cut -c1-200
}

dispatch session40 "${1:-}"
