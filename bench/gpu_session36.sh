#!/usr/bin/env bash
# GPU steps of the thirty-fourth session, for one H100 or H200 (every JSON names its card):
#
#   run(command="bash bench/gpu_session36.sh a")   # ≈ 8 min (ran in the thirty-fourth session on an H100,
#   bench/README.md, with a 240 s test limit that cut the last W8A8 GPU test; they take ~200 s alone)
#
# a: the W8A8 experts (`dspark/kernels/moe_w8a8.py`, CPU-tested under the interpreter and compiled for
#    sm_90): their GPU tests (V4-Flash shapes against the W8A8 reference, the side-stream input bit for bit)
#    with the MoE tests (the finalize launcher moved), then `bench/moe_w8a8.py`: V4-Flash MoE layer at
#    256 to 8192 tokens, FP8 128×128 and 32×32 weights, W8A8 (x quantised in line, or on a side stream
#    beside the router) against the weights-only FP8 path, and a sweep of W8A8 launch shapes at 8192.
# b: after a refactor of the W8A8 kernels (`_act_tile`), their small GPU tests, then whole-model prefill
#    (`bench/prefill_w8a8.py`): v4-mini with the shipped kernels against moe_experts="w8a8", 4096 and 8192
#    new tokens, alternating rounds.
# c: the v4-mini bf16 one-token decode MoE table entry moved to 8-row down blocks over 4 programs (after
#    `gpu_session32.sh a` on an H200, moe-split-ab-*-h200-s34.json): the v4-mini graph step with it ("new")
#    and with .ab/moe_decode_old.py ("old"), one round (carry .ab).
# d: (not run yet) the W8A8 GPU tests with their weights made on the device, then a W8A8 launch-shape sweep
#    at 8192 V4-Flash tokens with Triton's pipeline stages and the unspilled 4-warp 64×64 tile.
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, pack, dispatch

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  [ -n "${SKIP_TESTS:-}" ] || tests a_tests 420 --tb=line tests/kernels/test_moe_w8a8.py tests/kernels/test_moe.py \
    tests/kernels/test_registry.py
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null  # back even if the call runs out of time before `pack`
  logged a_bench 330 python3 bench/moe_w8a8.py --out "$OUT/moe-w8a8-$(card)-s34.json" \
    --tiles 64x128x8x8,64x128x4x4,128x128x8x8,64x256x8x8,128x64x4x4
  grep -v "^{\"gpu" "$W/logs/a_bench.txt" | cut -c1-400
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests b_tests 150 --tb=line tests/kernels/test_moe_w8a8.py -k "model or matches_the_w8a8 or early"
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  logged b_prefill 330 python3 bench/prefill_w8a8.py --out "$OUT/prefill-w8a8-$(card)-s34.json"
  grep -v "^{\"gpu" "$W/logs/b_prefill.txt" | cut -c1-400
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  AB_V41_ROUNDS=0 ab_steps c "${V4_ROUNDS:-1}" dspark/kernels/moe_decode.py
}

part_d() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests d_tests 300 --tb=line tests/kernels/test_moe_w8a8.py
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  logged d_sweep 300 python3 bench/moe_w8a8.py --tokens 8192 --out "$OUT/moe-w8a8-sweep-$(card)-s35.json" \
    --tiles 64x128x8x8x2,64x128x8x8x3,64x128x8x8x4,64x64x4x4,64x64x4x4x4,64x64x8x8,128x128x8x8x2
  grep -v "^{\"gpu" "$W/logs/d_sweep.txt" | cut -c1-300
}

dispatch session36 "${1:-}"
