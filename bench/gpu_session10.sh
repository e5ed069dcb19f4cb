#!/usr/bin/env bash
# GPU steps of the tenth session, 2026-12-01 (each part < 9.5 min on one H200):
#
#   run(command="bash bench/gpu_session10.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session10.sh c")
#   run(command="bash bench/gpu_session10.sh b")
#   run(command="bash bench/gpu_session10.sh d")
#   run(command="bash bench/gpu_session10.sh e")
#   run(command="bash bench/gpu_session10.sh f")   # not run: written after the device time ran out
#   run(command="bash bench/gpu_session10.sh g")   # not run: written after the device time ran out
#
# a: the ninth session's CPU-only ops (`hc_head_norm`: V4's output collapse + final RMSNorm in two
#    launches; `index_scores_pooled`: V4.1's pool block maxima in the indexer score kernel), both in
#    NOT_YET_ON_GPU, under their GPU tests; the v4-mini and v41-mini steps with them (--not-yet) and
#    without; where a DSpark round's time goes at one request: the drafter's propose and observe graphs
#    (bench/graph_draft.py --profile, PDL off for per-kernel attribution) and the target's 4-token
#    verify step (bench/graph_decode.py --tokens 4 --profile --no-pdl); the one-row GEMV against cuBLAS
#    with the weight prefetch (bench/linear_decode.py).
# c: the engine over the issue's whole load grid: 1 / 8 / 16 / 32 / 64 / 128 / 256 requests x no
#    speculation, MTP-1, DSpark budgets 1-3 and auto (round in flight), graphs + overlap, a constant
#    drafter confidence 0.8629 (budget 3 -> 3.25 tokens per round, the seeds' conversion), the auto
#    cells planning on the fixed cells' step times, at 4K (with HF transformers eager at batch 1) and 32K.
# b: the helpers' kernels under their GPU tests (all on by default except `step_index` and
#    `index_scores_pooled`): the mHC epilogues (loads before reductions, Sinkhorn by reciprocal, the
#    one-token folded row in registers), the V4.1 mHC statistics split over the streams, the indexer-q
#    RoPE over more programs, the histogram top-k selection, the 16-chunk attention merge, the 1-8-row
#    GEMV / compressor projection, `step_index` (every index tensor of a static step in one launch), the
#    indexer score kernel's chunked fp32 dot; then the v4-mini / v41-mini graph steps at 1 / 8 requests
#    with `step_index` + `index_scores_pooled` and without, the 4-token verify step, the PDL-off profile.
# d: the per-op benches of b's kernels: bench/mhc_epilogue.py, bench/latency_kernels.py,
#    bench/mhc_v41_site.py, bench/linear_decode.py --rows, bench/argmax_rows.py, and the DSpark propose
#    graph after the two-pass argmax (bench/graph_draft.py).
# e (instead of d, for the device time left): b's failures again with their messages (the step-index
#    tests that built their models on the CPU, the multi-row fp32 GEMV / projection at K = 1500), the
#    GPU tests b's timeouts cut (V4.1 mHC, PDL chains, static-step kernels, CUDA-graph replays), the
#    v41-mini step without step_index / pooled scores (b's comparison), and the V4.1 mHC site bench.
# f: MTP-1 on the static slots (`EngineConfig(static_decode=True)`, CPU-tested only) under its GPU test
#    (graphs replayed, the default engine's tokens), then the engine's none / mtp1 cells at 1 / 8 / 64 /
#    256 requests, 4K (bench/engine_h200.py --static-decode: the mtp1 cells take the static path).
# g: auto's round in flight with budget 0 (plain steps, the drafter observing; CPU-tested only) under its
#    GPU tests, then the engine at 64 / 128 / 256 requests, 4K: auto / best fixed where plain is best.
#
# Only 8 files come back from a call, so every part ends by packing $OUT into one session10-PART.tgz.
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack



part_a() {
  tests a_tests 170 tests/kernels/test_hc_head_norm.py tests/kernels/test_hc_head_norm_model.py \
    "tests/kernels/test_cuda_graphs.py::test_mhc_ops_replay" tests/kernels/test_indexer_pool_fused.py \
    tests/kernels/test_indexer_pool.py tests/kernels/test_lightning_indexer.py
  step graph-decode-h200-s10-hc-head 55 --requests 1,8 --not-yet
  step graph-decode-h200-s10-base 55 --requests 1,8
  step graph-decode-v41-mini-h200-s10-pooled 60 --config v41-mini --requests 1,8 --not-yet
  step graph-decode-v41-mini-h200-s10-base 60 --config v41-mini --requests 1,8
  logged a_draft 80 python3 bench/graph_draft.py --requests 1 --profile --no-pdl --out "$OUT/graph-draft-h200-s10-profile.json"
  grep -h "^{" $W/logs/a_draft.txt | cut -c1-1200; tail -n 2 $W/logs/a_draft.txt | cut -c1-200
  step graph-verify-h200-s10-profile 55 --requests 1 --tokens 4 --profile --no-pdl
  logged a_linear 70 python3 bench/linear_decode.py --no-sweep --out "$OUT/linear-decode-h200-s10.json"
  tail -n 25 $W/logs/a_linear.txt | cut -c1-250
}

part_b() {
  tests b_tests1 170 tests/kernels/test_step_index.py tests/models/test_deepseek_v4_step_index.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py \
    tests/kernels/test_mhc.py tests/kernels/test_mhc_norm.py tests/kernels/test_hc_head_norm.py tests/kernels/test_mhc_v41.py \
    tests/kernels/test_kernels_pdl.py
  tests b_tests2 150 tests/kernels/test_kernels_norm_rope.py tests/kernels/test_lightning_indexer.py \
    tests/kernels/test_indexer_pool_fused.py tests/kernels/test_sparse_attention.py tests/kernels/test_linear.py \
    tests/kernels/test_static_step_kernels.py "tests/kernels/test_cuda_graphs.py"
  step graph-decode-h200-s10-b 50 --requests 1,8 --triton step_index,index_scores_pooled
  step graph-decode-h200-s10-b-base 50 --requests 1,8
  step graph-decode-v41-mini-h200-s10-b 55 --config v41-mini --requests 1,8 --triton step_index,index_scores_pooled
  step graph-verify-h200-s10-b 50 --requests 1 --tokens 4 --triton step_index
  step graph-profile-h200-s10-b-no-pdl 50 --requests 1 --triton step_index --no-pdl --profile
}

part_d() {
  logged d_epi 150 python3 bench/mhc_epilogue.py --out "$OUT/mhc-epilogue-h200.json"
  tail -n 15 $W/logs/d_epi.txt | cut -c1-300
  logged d_lat 120 python3 bench/latency_kernels.py --out "$OUT/latency-kernels-h200.json"
  tail -n 15 $W/logs/d_lat.txt | cut -c1-300
  logged d_v41 120 python3 bench/mhc_v41_site.py --out "$OUT/mhc-v41-site-h200.json"
  tail -n 12 $W/logs/d_v41.txt | cut -c1-300
  logged d_rows 100 python3 bench/linear_decode.py --no-sweep --rows 1,2,4,8 --out "$OUT/linear-rows-h200.json"
  tail -n 12 $W/logs/d_rows.txt | cut -c1-300
  logged d_argmax 40 python3 bench/argmax_rows.py --out "$OUT/argmax-rows-h200.json"
  tail -n 6 $W/logs/d_argmax.txt | cut -c1-300
  logged d_draft 70 python3 bench/graph_draft.py --requests 1,8 --out "$OUT/graph-draft-h200-s10.json"
  grep -h "^{" $W/logs/d_draft.txt | cut -c1-600
}

part_e() {
  logged e_failed 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/kernels/test_step_index.py \
    tests/kernels/test_linear.py -k "step or multi_row"
  grep -h "^E  \|^FAILED\|passed\|failed\|Error" $W/logs/e_failed.txt | head -n 30 | cut -c1-300
  tests e_rest 110 tests/kernels/test_mhc_v41.py tests/kernels/test_kernels_pdl.py tests/kernels/test_static_step_kernels.py \
    tests/kernels/test_cuda_graphs.py
  step graph-decode-v41-mini-h200-s10-e-base 50 --config v41-mini --requests 1,8
  logged e_v41 55 python3 bench/mhc_v41_site.py --out "$OUT/mhc-v41-site-h200.json"
  tail -n 12 $W/logs/e_v41.txt | cut -c1-300
}

part_f() {
  tests f_tests 150 tests/engine/test_engine_static_gpu.py -k mtp
  logged f_engine 330 python3 bench/engine_h200.py --static-decode --overlap --requests 1,8,64,256 --contexts 4096 \
    --modes none,mtp1 --decode-only --steps 8 --budget-s 280 --out "$OUT/engine-h200-mtp-static.json"
  tail -n 30 $W/logs/f_engine.txt | cut -c1-300
}

part_g() {
  tests g_tests 150 -m gpu tests/engine/test_engine_draft_lookahead_plain.py tests/engine/test_engine_draft_lookahead_auto.py \
    tests/engine/test_engine_draft_lookahead.py
  logged g_engine 400 python3 bench/engine_h200.py --static-decode --overlap --requests 64,128,256 --contexts 4096 \
    --modes none,dspark1,dspark2,dspark3,auto_async --decode-only --steps 8 --confidence 0.8629 --table-from-cells \
    --budget-s 360 --out "$OUT/engine-h200-zero.json"
  tail -n 30 $W/logs/g_engine.txt | cut -c1-300
}

part_c() {
  local grid=(--static-decode --overlap --requests 1,8,16,32,64,128,256 --modes none,mtp1,dspark1,dspark2,dspark3,auto_async
              --decode-only --steps 8 --confidence 0.8629 --table-from-cells)
  logged c_engine_4k 330 python3 bench/engine_h200.py "${grid[@]}" --contexts 4096 --budget-s 280 --peer \
    --out "$OUT/engine-h200-s10.json"
  tail -n 40 $W/logs/c_engine_4k.txt | cut -c1-300
  logged c_engine_32k 250 python3 bench/engine_h200.py "${grid[@]}" --contexts 32768 --budget-s 210 \
    --out "$OUT/engine-h200-s10-32k.json"
  tail -n 30 $W/logs/c_engine_32k.txt | cut -c1-300
}

case "${1:?part: a to g}" in
  a) part_a ;;
  b) part_b ;;
  d) part_d ;;
  e) part_e ;;
  f) part_f ;;
  g) part_g ;;
  c) part_c ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
pack "session10-$1"
