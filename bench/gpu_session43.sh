#!/usr/bin/env bash
# GPU steps of the thirty-ninth session (one H100 or H200; every JSON names its card):
#
#   run(command="bash bench/gpu_session43.sh a")   # ≈ 3 min
#   run(command="bash bench/gpu_session43.sh b")   # ≈ 8 min
#   run(command="bash bench/gpu_session43.sh c")   # ≈ 3 min
#   run(command="bash bench/gpu_session43.sh d")   # ≈ 7 min
#   run(command="bash bench/gpu_session43.sh e")   # ≈ 4 min
#   run(command="bash bench/gpu_session43.sh f")   # ≈ 7 min
#   run(command="bash bench/gpu_session43.sh g")   # ≈ 3 min, an H200 only (else it does nothing)
#
# a: the decode MoE with its weights streamed by TMA (`dspark/kernels/moe_decode_tma.py`: the same two
#    launches as `moe_decode`, the weight tiles copied by descriptor loads in a pipelined loop) against the
#    shipped GEMV kernels, each kernel alone, the experts op and the whole op with the router, V4-Flash
#    and v4-mini, bf16 / FP8 128×128 / FP8 32×32, 1 and 8 tokens (`bench/moe_decode_tma.py`), after the
#    new kernels' GPU tests. (Ran at the tree of dadc7f6; the kernels' second form, below, keeps the TMA
#    gate/up kernel only, so at later commits a fails in its first step.)
# b: the gate/up launch through TMA shipped (`moe_decode.UP_TMA`): the GPU tests of both decode kernels and
#    of V4's and V4.1's static graphs; issue 6's whole op (router included, `bench/kernels.py`'s cases) with
#    UP_TMA and with the GEMV kernel, in turn (`bench/moe_decode_tma.py --ab`); the v4-mini graph step at 1
#    and 8 requests and v41-mini's at 1 captured with the GEMV kernel against the shipped graph
#    (`bench/graph_decode.py --gemv-ab moe_up_gemv`). (Ran at cf40400; its decode tests were cut by their
#    120 s limit after 168 passed, none failed.)
# c: the TMA gate/up kernel alone over more shapes (8-row programs, 3 / 5 / 7 stages) against the GEMV
#    kernel (`bench/moe_decode_tma.py`).
# d: the decode MoE's GPU tests in full (test_moe.py's decode cases and test_moe_decode_tma.py), then c.
# e: d's tests alone.
# f: e's tests, then the TMA down kernel (`moe_decode_tma.tma_down`: its expert slots split over programs per
#    row block, a bench variant outside the tables) over `DOWN_SWEEP` × 1 / 2 / 4 / 7 programs against the
#    GEMV down kernel, and the experts op with the best of it against the shipped op, in turn
#    (`bench/moe_decode_tma.py --down`).
# g: on an H200, issue 6's MoE rows as the thirty-sixth session measured them (`bench/kernels.py --graph`,
#    V4-Flash, the whole op with the router at 1, 8 and 64 tokens), with the TMA gate/up launch.
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, step, pack, dispatch, moe_rows_h200

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests a_tests 150 tests/kernels/test_moe_decode_tma.py
  logged "moe-decode-tma-$(card)-s39" 420 python3 bench/moe_decode_tma.py --out "$OUT/moe-decode-tma-$(card)-s39.json"
  grep -h "experts shipped" "$W/logs/moe-decode-tma-$(card)-s39.txt" | cut -c1-400
  tail -n 3 "$W/logs/moe-decode-tma-$(card)-s39.txt" | cut -c1-300
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests b_tests 120 tests/kernels/test_moe_decode_tma.py tests/kernels/test_moe.py -k "decode or tma"
  tests b_graphs 150 tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  logged "moe-tma-ab-$(card)-s39" 240 python3 bench/moe_decode_tma.py --ab --out "$OUT/moe-tma-ab-$(card)-s39.json"
  grep -h "gemv" "$W/logs/moe-tma-ab-$(card)-s39.txt" | cut -c1-300
  step "moe-up-ab-v4-$(card)-s39" 200 --requests 1,8 --gemv-ab moe_up_gemv
  step "moe-up-ab-v41-$(card)-s39" 150 --config v41-mini --requests 1 --gemv-ab moe_up_gemv
  grep -h "gemv_ab_ms" "$W"/logs/moe-up-ab-*.txt | cut -c1-500
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged "moe-tma-up-$(card)-s39" 400 python3 bench/moe_decode_tma.py --out "$OUT/moe-tma-up-$(card)-s39.json"
  grep -h "up gemv" "$W/logs/moe-tma-up-$(card)-s39.txt" | cut -c1-300
}

part_d() {
  part_e
  part_c
}

part_e() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests moe_tests 170 tests/kernels/test_moe_decode_tma.py tests/kernels/test_moe.py -k "decode or tma"
}

part_f() {
  part_e
  logged "moe-tma-down-$(card)-s39" 400 python3 bench/moe_decode_tma.py --down --out "$OUT/moe-tma-down-$(card)-s39.json"
  grep -h "down gemv" "$W/logs/moe-tma-down-$(card)-s39.txt" | cut -c1-300
}

part_g() {  # an H200 only (issue 6's card)
  moe_rows_h200 s39
}

dispatch session43 "${1:-}"
