#!/usr/bin/env bash
# GPU steps of the forty-sixth session (every JSON names its card):
#
#   run(command="bash bench/gpu_session50.sh a", carry=[".whl"])   # ≈ 7 min on an H200, ≈ 8 on an H100 (the
#                                               # drafter's weights moved out of the tree for the carry limit)
#   run(command="bash bench/gpu_session50.sh b")   # ≈ 8 min (four variants)
#   run(command="bash bench/gpu_session50.sh c")   # ≈ 7 min, an H200 only (else it does nothing)
#
# a: on an H200, issue 6's deciding figures (`gpu_lib.issue6_h200_or`: the MoE rows after the read and the write
#    flush, the 32K decode attention on flashinfer), last measured there in the thirty-sixth session; on an H100,
#    part b.
# b: the GPU tests of `linear` (with `linear_rope`), the q norm fold, `grouped_wo_a` and PDL, then four step
#    candidates against the shipped step (`bench/graph_decode.py --gemv-ab`): `k_tile_2048` (`linear.GEMV_K_TILE`
#    2048), `head_weights_early` (`side_stream.HEAD_WEIGHTS_EARLY`), `rope_epilogue` (`linear.ROPE_EPILOGUE`: the
#    indexers' queries rotated in their GEMV's epilogue, one launch fewer per CSA layer) and `q_norm_fold`
#    (`attention.Q_NORM_FOLD`: V4's per-head q norm and RoPE in the attention's partial kernel, one launch fewer per
#    layer; V4.1 has no per-head q norm, so there it is a control), v4-mini at 1, 2 and 4 requests, again at 1 in a
#    second process, and v41-mini at one.
# c: issue 7's engine grid on its card (v4-mini, 4K, 1 and 64 requests: none, DSpark 1-3 and the async auto
#    planner, HF eager `generate` as the peer in the same call), last timed on an H200 in the thirty-sixth session.
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, step, tests, dispatch, issue6_h200_or

VARIANTS=k_tile_2048,head_weights_early,rope_epilogue,q_norm_fold

part_a() { issue6_h200_or s46 part_b; }

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests "gpu-tests-candidates-$(card)-s46" 100 -m gpu tests/kernels/test_linear.py tests/kernels/test_linear_rope.py \
    tests/kernels/test_attention_qnorm.py tests/kernels/test_grouped_wo_a.py tests/kernels/test_kernels_pdl.py
  step "candidates-ab-v4-$(card)-s46-1" 180 --requests 1,2,4 --gemv-ab "$VARIANTS"
  step "candidates-ab-v41-$(card)-s46" 120 --config v41-mini --requests 1 --gemv-ab "$VARIANTS"
  step "candidates-ab-v4-$(card)-s46-2" 120 --requests 1 --gemv-ab "$VARIANTS"
  grep -h "gemv_ab_speedup" "$W"/logs/candidates-ab-*.txt | grep -o '"\(k_tile_2048\|head_weights_early\|rope_epilogue\|q_norm_fold\)": [0-9.]*'
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  if [ "$(card)" = h200 ]; then
    logged engine 420 python3 bench/engine_h200.py --static-decode --overlap --decode-only --peer --steps 8 \
      --confidence 0.8629 --table-from-cells --modes none,dspark1,dspark2,dspark3,auto_async --requests 1,64 \
      --contexts 4096 --budget-s 300 --out "$OUT/engine-h200-s46.json"
    tail -n 16 "$W/logs/engine.txt" | cut -c1-300
  fi
}

dispatch session50 "${1:-}"
