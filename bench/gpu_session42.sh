#!/usr/bin/env bash
# GPU steps of the thirty-eighth session, for one H200 (an H100 runs them too; every JSON names its card):
#
#   run(command="bash bench/gpu_session42.sh a", carry=[".whl"])   # ≈ 7 min (+ ≈ 3 on an H200)
#   (.whl: the flashinfer wheels, see gpu_session29.sh; without them part a skips the attention step)
#   run(command="bash bench/gpu_session42.sh b")                   # ≈ 7 min
#   run(command="bash bench/gpu_session42.sh d")                   # ≈ 6 min
#   run(command="bash bench/gpu_session42.sh e")                   # ≈ 3 min
#   run(command="bash bench/gpu_session42.sh f")                   # ≈ 5 min
#   run(command="bash bench/gpu_session42.sh g")                   # ≈ 3 min
#   run(command="bash bench/gpu_session42.sh h")                   # ≈ 5 min
#   run(command="bash bench/gpu_session42.sh c", carry=[".whl"])   # ≈ 9 min, an H200 only (else it does nothing)
#
# a: 1. the decode GEMV on v4-mini's K = 512 weights (the heads' `wq_b` [16384, 512] and the indexer's
#       `wq_b` [8192, 512], on torch's matmul as shipped because the GEMV lost to cuBLAS timed alone):
#       the batch-1 and batch-8 graph steps captured with the GEMV at three tile shapes against the
#       shipped graph, timed in turn in one process (`bench/graph_decode.py --gemv-ab`); v41-mini at 1.
#    2. the v4-mini batch-1 step's kernels with PDL off (`--profile --no-pdl`), comparable with the
#       twenty-ninth session's `v4-profile-h100-s29.json`: where issue 7's step goes now.
#    3. on an H200 only (the issue's card) with .whl carried: flashinfer's MLA decode attention with the
#       sink pass at 32K for 256 and 512 requests (issue 6's 70 % row, last measured in the sixth session).
# (a ran on the tree of 1e308d6 with the first --gemv-ab, whose variants widened the rule; since 814d689
#  the variants are b's.)
# b: at the tree with linear's SHORT_K rule shipped (814d689) and `grouped_wo_a` at 1-4 bf16 rows as one GEMV
#    launch (`_wo_a_gemv_kernel`, first written in the thirty-third session and timed then only together
#    with two other folds that lost): the GPU tests of both kernels, PDL and V4's / V4.1's static graphs;
#    then `--gemv-ab` (the shipped graph against torch's matmul on the K = 512 weights, the GEMV there
#    up to 4 rows, other GEMV tiles, and wo_a's split kernel + sum) at 1, 2 and 4 requests, the batch-1
#    4-token verify block, and v41-mini at 1 request.
# d: `linear_rms_norm` (the attention's wq_a GEMV and q_norm in one launch, the last program to take a
#    ticket normalising the row; from bc55aed, timed in the thirty-third session only together with two
#    other folds that lost, registry.NOT_YET_ON_GPU): its GPU tests and linear's, then `--gemv-ab` with
#    `--triton linear_rms_norm` (its variant "q_norm_apart" the two launches) at 1, 2 and 4 requests and
#    v41-mini at 1. It ran on the tree of 0405a31 with bc55aed's files and that variant added, uncommitted;
#    the fold lost (0.990-0.995x) and both were taken out again, so at later commits d fails to start.
# e: bounds for a compressor change: the v4-mini graph step at 1 and 8 requests captured without every
#    compressor's pooling, and without every compressor update (wrong logits: what skipping the pooling
#    of entries not complete yet could save at most), with `--gemv-ab`'s variants again, timed in turn.
# f: the tree of 2790aa1 (linear's SHORT_K_TILE: the (8, 4) tiles at K = 512): linear's and grouped_wo_a's
#    GPU tests, then `--gemv-ab` (torch's matmul on the K = 512 weights, the (16, 8) tiles there, wo_a's
#    split kernel) at 1 and 8 requests and v41-mini at 1. The (8, 4) tiles broke the multi-row GEMV's
#    bit equality with one-row launches at K = 512 and were within noise (0.998x / 1.005x), so the next
#    commit took SHORT_K_TILE out: at later commits f's "gemv_n8" variant is that shape.
# g: the multi-row GEMV in the step: `--gemv-ab` (its variant "gemv_one_row": linear's GEMV_MAX_ROWS 1, so
#    2-4 row calls go to torch's matmul) at 2 and 4 requests and at the batch-1 4-token verify block.
#    (Ran on the tree of 39ca06c with that variant added.)
# h: (ran in the forty-fifth session on an H100: 1.009-1.011x, bench README) the one-row GEMV on rows of 2048 in one K tile (`--gemv-ab`'s "one_k_tile":
#    wq_a, wkv, wo_b, weights_proj at BLOCK_K 2048, all of a program's loads in one round trip, where the
#    shipped tiles take two 1024-wide steps) at 1 request, v4-mini and v41-mini, two processes each.
# c: on an H200: a's attention step and the engine bench of issue 7 (`gpu_session37.sh c`'s command).
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, step, pack, dispatch, attention_32k

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  step "gemv-ab-v4-$(card)-s38" 240 --requests 1,8 --gemv-ab
  step "gemv-ab-v41-$(card)-s38" 200 --config v41-mini --requests 1 --gemv-ab
  grep -h "gemv_ab" "$W"/logs/gemv-ab-*.txt | cut -c1-600
  step "v4-profile-nopdl-$(card)-s38" 150 --requests 1 --profile --no-pdl
  if [ "$(card)" = h200 ]; then attention_32k s38; fi
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests b_tests 240 tests/kernels/test_linear.py tests/kernels/test_grouped_wo_a.py tests/kernels/test_kernels_pdl.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  step "gemv-wo-a-ab-v4-$(card)-s38" 240 --requests 1,2,4 --gemv-ab
  step "gemv-wo-a-ab-v4-verify-$(card)-s38" 150 --requests 1 --tokens 4 --gemv-ab
  step "gemv-wo-a-ab-v41-$(card)-s38" 200 --config v41-mini --requests 1 --gemv-ab
  grep -h "gemv_ab_ms" "$W"/logs/gemv-wo-a-ab-*.txt | cut -c1-700
}

part_d() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests d_tests 200 tests/kernels/test_linear_rms_norm.py tests/kernels/test_linear.py
  step "lrn-ab-v4-$(card)-s38" 240 --requests 1,2,4 --gemv-ab --triton linear_rms_norm
  step "lrn-ab-v41-$(card)-s38" 200 --config v41-mini --requests 1 --gemv-ab --triton linear_rms_norm
  grep -h "gemv_ab_ms" "$W"/logs/lrn-ab-*.txt | cut -c1-800
}

part_e() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  step "bounds-v4-$(card)-s38" 240 --requests 1,8 --gemv-ab --bounds
  grep -h "gemv_ab_ms" "$W"/logs/bounds-*.txt | cut -c1-900
}

part_f() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests f_tests 150 tests/kernels/test_linear.py tests/kernels/test_grouped_wo_a.py
  step "final-ab-v4-$(card)-s38" 200 --requests 1,8 --gemv-ab
  step "final-ab-v41-$(card)-s38" 150 --config v41-mini --requests 1 --gemv-ab
  grep -h "gemv_ab_ms" "$W"/logs/final-ab-*.txt | cut -c1-700
}

part_g() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  step "rows-ab-v4-$(card)-s38" 120 --requests 2,4 --gemv-ab
  step "rows-ab-v4-verify-$(card)-s38" 100 --requests 1 --tokens 4 --gemv-ab
  grep -h "gemv_ab_ms" "$W"/logs/rows-ab-*.txt | cut -c1-700
}

part_h() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  local round
  for round in 1 2; do
    step "one-k-tile-v4-$(card)-s38-$round" 100 --requests 1 --gemv-ab
    step "one-k-tile-v41-$(card)-s38-$round" 100 --config v41-mini --requests 1 --gemv-ab
  done
  grep -h "gemv_ab_ms" "$W"/logs/one-k-tile-*.txt | cut -c1-700
}

part_c() {  # an H200 only (issue 6's and 7's card)
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  if [ "$(card)" = h200 ]; then
    attention_32k s38
    logged engine 420 python3 bench/engine_h200.py --static-decode --overlap --decode-only --peer --steps 8 \
      --confidence 0.8629 --table-from-cells --modes none,dspark1,dspark2,dspark3,auto_async --requests 1,64 \
      --contexts 4096 --budget-s 300 --out "$OUT/engine-h200-s38.json"
    tail -n 16 "$W/logs/engine.txt" | cut -c1-300
  fi
}

dispatch session42 "${1:-}"
