#!/usr/bin/env bash
# GPU steps of the forty-third session (one H100 or H200; every JSON names its card):
#
#   run(command="bash bench/gpu_session47.sh a", carry=[".whl"])   # ≈ 7 min on an H200, ≈ 2 on an H100 (the
#                                               # drafter's weights moved out of the tree for the carry limit)
#   run(command="bash bench/gpu_session47.sh b")   # ≈ 8 min on an H200, else nothing
#   run(command="bash bench/gpu_session47.sh c")   # ≈ 6 min
#   run(command="bash bench/gpu_session47.sh d")   # ≈ 5 min
#   run(command="bash bench/gpu_session47.sh e", carry=[".whl"])   # ≈ 8 min on an H200, ≈ 5 on an H100
#   run(command="bash bench/gpu_session47.sh f")   # ≈ 4 min
#
# a: on an H200, issue 6's figures after the read flush, the ones that decide its MoE and attention targets:
#    the V4-Flash MoE rows (`bench/kernels.py --graph`, the whole op with its router at 1, 8 and 64 tokens)
#    after the read flush and then the write flush, and the 32K decode attention on flashinfer (the graph with
#    the sink pass and the kernel alone, after either flush). On an H100, Nsight Compute on the one-token
#    FP8 32×32 experts, the cell furthest from issue 6's 60 %: the one launch the tables ship (`FUSED`) and the
#    two launches it replaced (`bench/moe_decode_ncu.py --block 32 [--no-fused]`).
# b: on an H200 only, the one-token launch forms that lost on an H100 but were never timed on the H200, where
#    the one-token op is further from the copy bandwidth (more bytes must be in flight per SM): the TMA down
#    kernel (`bench/moe_decode_tma.py --down`: its shapes alone, then issue 6's whole op with the best in the
#    tables against the op as shipped, in turn) and the experts in one launch (`--fused`), V4-Flash FP8
#    128×128; then for FP8 32×32 the shipped one launch against the two launches with the shared rows started
#    early (`--early`'s "early" and "early_two" sides).
# c: the one launch's EARLY form (`FUSED`: FP8 32×32 and bf16 at one token, V4-Flash widths; its counters
#    zeroed before the router, the shared rows' gate/up items streaming while the router runs): the TMA
#    kernels' GPU tests (bit for bit against the late launch, 20 times), then issue 6's whole op as shipped
#    against the op with none of the early starts and against the two launches with theirs
#    (`bench/moe_decode_tma.py --early`: "early", "late", "early_two"); then for FP8 128×128 the one launch,
#    now early, against the two launches as shipped (`--fused`).
# d: after c, with the one launch for FP8 128×128 too (`FUSED`) and c's GPU-test fixes: the TMA kernels'
#    GPU tests again, then issue 6's whole op at one token, V4-Flash FP8 128×128, 32×32 and bf16, as shipped
#    against the op with none of the early starts and against the two launches with theirs (`--early`).
# e: on an H200 issue 6's MoE rows after the read flush and the 32K attention (a without the write-flushed
#    rows); on an H100 part d (its GPU tests and op timings).
# f: the shortest of e: on an H200 issue 6's MoE rows after the read flush; on an H100 d's GPU tests.
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, pack, dispatch, moe_rows_h200, attention_32k, ncu_experts,
# tma_tests_then_early

part_a() {
  if [ "$(card)" = h200 ]; then
    moe_rows_h200 s43  # the read flush, `bench/kernels.py`'s default
    moe_rows_h200 s43 write
    attention_32k s43
  else
    nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
    ncu_experts "moe-decode-ncu-fp8-32-m1-fused-$(card)-s43" --block 32 --tokens 1
    ncu_experts "moe-decode-ncu-fp8-32-m1-two-$(card)-s43" --block 32 --tokens 1 --no-fused
  fi
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  [ "$(card)" = h200 ] || { echo "not an H200: nothing to run"; return 0; }
  logged moe-tma-down-h200-s43 200 python3 bench/moe_decode_tma.py --down --layers v4-flash --kinds fp8 --tokens 1 \
    --out "$OUT/moe-tma-down-h200-s43.json"
  grep -h "down\|op " "$W/logs/moe-tma-down-h200-s43.txt" | cut -c1-220 | tail -n 20
  logged moe-fused-h200-s43 200 python3 bench/moe_decode_tma.py --fused --layers v4-flash --kinds fp8 --tokens 1 \
    --out "$OUT/moe-fused-h200-s43.json"
  grep -h "fused\|op " "$W/logs/moe-fused-h200-s43.txt" | cut -c1-220 | tail -n 20
  logged moe-early-h200-s43 150 python3 bench/moe_decode_tma.py --early --layers v4-flash --kinds fp8-32 --tokens 1 \
    --out "$OUT/moe-early-h200-s43.json"
  grep -h "early" "$W/logs/moe-early-h200-s43.txt" | cut -c1-300 | tail -n 5
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests "gpu-tests-fused-early-$(card)-s43" 240 tests/kernels/test_moe_decode_tma.py
  logged "moe-early-fused-$(card)-s43" 150 python3 bench/moe_decode_tma.py --early --layers v4-flash \
    --kinds fp8-32,bf16 --tokens 1 --out "$OUT/moe-early-fused-$(card)-s43.json"
  grep -h "early" "$W/logs/moe-early-fused-$(card)-s43.txt" | cut -c1-300 | tail -n 4
  logged "moe-fused-early-$(card)-s43" 150 python3 bench/moe_decode_tma.py --fused --layers v4-flash --kinds fp8 \
    --tokens 1 --out "$OUT/moe-fused-early-$(card)-s43.json"
  grep -h "fused\|op " "$W/logs/moe-fused-early-$(card)-s43.txt" | cut -c1-300 | tail -n 4
}

part_d() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tma_tests_then_early "gpu-tests-fused-early-d-$(card)-s43" "moe-early-fused-d-$(card)-s43"
}

part_e() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  if [ "$(card)" = h200 ]; then
    moe_rows_h200 s43
    attention_32k s43
  else
    tma_tests_then_early "gpu-tests-fused-early-e-$(card)-s43" "moe-early-fused-e-$(card)-s43"
  fi
}

part_f() {
  if [ "$(card)" = h200 ]; then
    moe_rows_h200 s43
  else
    nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
    tests "gpu-tests-fused-early-f-$(card)-s43" 240 tests/kernels/test_moe_decode_tma.py
  fi
}

dispatch session47 "${1:-}"
