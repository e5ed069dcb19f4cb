#!/usr/bin/env bash
# GPU steps of the thirty-ninth session (one H100 or H200; every JSON names its card):
#
#   run(command="bash bench/gpu_session43.sh a")   # ≈ 6 min
#
# a: the decode MoE with its weights streamed by TMA (`dspark/kernels/moe_decode_tma.py`: the same two
#    launches as `moe_decode`, the weight tiles copied by descriptor loads in a pipelined loop) against the
#    shipped GEMV kernels, each kernel alone, the experts op and the whole op with the router, V4-Flash
#    and v4-mini, bf16 / FP8 128×128 / FP8 32×32, 1 and 8 tokens (`bench/moe_decode_tma.py`), after the
#    new kernels' GPU tests.
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, step, pack, dispatch, with_flashinfer

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests a_tests 150 tests/kernels/test_moe_decode_tma.py
  logged "moe-decode-tma-$(card)-s39" 420 python3 bench/moe_decode_tma.py --out "$OUT/moe-decode-tma-$(card)-s39.json"
  grep -h "experts shipped" "$W/logs/moe-decode-tma-$(card)-s39.txt" | cut -c1-400
  tail -n 3 "$W/logs/moe-decode-tma-$(card)-s39.txt" | cut -c1-300
}

dispatch session43 "${1:-}"
