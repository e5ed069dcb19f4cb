#!/usr/bin/env bash
# GPU steps of the ninth session, 2026-12-01 (each part < 9.5 min on one H200):
#
#   run(command="bash bench/gpu_session9.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session9.sh b")
#   run(command="bash bench/gpu_session9.sh c")
#   run(command="bash bench/gpu_session9.sh d")
#   run(command="bash bench/gpu_session9.sh e")
#   run(command="bash bench/gpu_session9.sh f")
#   run(command="bash bench/gpu_session9.sh g")
#   run(command="bash bench/gpu_session9.sh h")
#
# a: last session's CPU-only work on the GPU: norm_rope (RMSNorm + RoPE of q heads / kv latents in one
#    launch; the window latents stored at their ring rows) under its GPU tests, the v4-mini graph step
#    with and without it (PDL on, the timing A/B), then with it and PDL off under the profiler (per-kernel
#    attribution: with PDL on a kernel's time includes its wait for the one before).
# b: the weight prefetch before the PDL wait (`triton_compat.pdl_prefetch`, in the one-row GEMV and the
#    compressor projection): their GPU tests, a chain of 24 GEMV layers with it / without it / without
#    PDL (bench/pdl_prefetch.py), then the v4-mini graph step with and without it.
# c: the CSA key list written by the selection kernel (`select_topk(..., offset=, out=)`), the
#    all-heads decode attention kernel (`attention_wide`) and the auto budget with a round in flight under
#    their GPU tests; the attention launch shapes at 32K (bench/attn_variants.py); the v4-mini step.
# d: the V4 mHC sites with the sublayer RMSNorm folded in (`mhc_pre_norm`, `mhc_post_pre_norm`, in
#    NOT_YET_ON_GPU) and the mHC statistics' fn prefetch under their GPU tests, per site (bench/mhc_norm_site.py)
#    and in the step (with / without the folds; the folds without the prefetch); the deep_gemm path's
#    fallback and contract double on CUDA tensors (bench/deep_gemm_check.py).
# e: the folds' tests once more (bound fixed after d), then the engine with everything on by default:
#    no speculation, DSpark budgets 1-3, auto (Algorithm 1, synchronous) and auto_async (a uniform budget
#    from confidences two rounds old, round in flight), graphs + overlap, 1 / 8 / 64 requests at 4K, a
#    constant drafter confidence 0.8629 (budget 3 -> 3.25 tokens per round, the seeds' conversion), the
#    auto cells planning on the fixed cells' step times; HF transformers eager at batch 1 as the peer.
# f: part e's engine grid at 32K context (no HF peer).
# g: the mHC statistics split over the streams at a few tokens (`mhc.SPLIT_STREAMS_MAX_TOKENS`) and the
#    one-round epilogue reduction under the mHC GPU tests; per site with / without it (folded and unfused
#    pairs, bench/mhc_norm_site.py); the v4-mini step, and its PDL-off attribution profile at one request.
# h (not run: written after the device time ran out): `hc_head_norm` (the V4 output collapse + final
#    RMSNorm in two launches) and `index_scores_pooled` (V4.1's pool block maxima in the indexer score
#    kernel), both NOT_YET_ON_GPU, under their GPU tests; the v4-mini and v41-mini steps with them
#    (--not-yet) and without.
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests


part_a() {
  logged a_tests 200 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_norm_rope.py \
    "tests/kernels/test_cuda_graphs.py::test_norm_and_rope_replay" tests/kernels/test_kernels_pdl.py \
    tests/kernels/test_static_step_kernels.py tests/models/test_deepseek_v4_static_graph_gpu.py
  tail -n 4 $W/logs/a_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/a_tests.txt | head -n 20 | cut -c1-300
  step graph-decode-h200-s9-norm-rope 100 --requests 1,8 --not-yet
  step graph-decode-h200-s9-base 100 --requests 1,8
  step graph-profile-h200-s9-no-pdl 100 --requests 1 --not-yet --no-pdl --profile
}

part_b() {
  logged b_tests 200 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_linear.py \
    tests/kernels/test_kernels_pdl.py
  tail -n 4 $W/logs/b_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/b_tests.txt | head -n 20 | cut -c1-300
  logged b_chain 120 python3 bench/pdl_prefetch.py --out "$OUT/pdl-prefetch-h200.json"
  grep -h "^{" $W/logs/b_chain.txt | cut -c1-200
  step graph-decode-h200-s9-prefetch 100 --requests 1,8
  step graph-decode-h200-s9-no-prefetch 100 --requests 1,8 --no-prefetch
}

part_c() {
  logged c_tests 200 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_lightning_indexer.py \
    tests/kernels/test_attention_wide.py tests/models/test_deepseek_v4_static_graph_gpu.py
  tail -n 4 $W/logs/c_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/c_tests.txt | head -n 20 | cut -c1-300
  logged c_auto 100 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/engine/test_engine_draft_lookahead_auto.py
  tail -n 3 $W/logs/c_auto.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/c_auto.txt | head -n 10 | cut -c1-300
  logged c_attn 260 python3 bench/attn_variants.py --out "$OUT/attn-variants-h200.json"
  tail -n 40 $W/logs/c_attn.txt | cut -c1-250
  step graph-decode-h200-s9-select 90 --requests 1,8
}

part_d() {
  logged d_tests 170 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_mhc_norm.py \
    tests/kernels/test_mhc_norm_model.py "tests/kernels/test_cuda_graphs.py::test_mhc_ops_replay" \
    tests/kernels/test_kernels_pdl.py tests/kernels/test_mhc.py tests/kernels/test_deep_gemm_path.py \
    tests/kernels/test_moe_deep_gemm.py
  tail -n 4 $W/logs/d_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/d_tests.txt | head -n 20 | cut -c1-300
  logged d_site 60 python3 bench/mhc_norm_site.py --out "$OUT/mhc-norm-site-h200.json"
  tail -n 12 $W/logs/d_site.txt | cut -c1-250
  logged d_deep_gemm 80 python3 bench/deep_gemm_check.py --out "$OUT/deep-gemm-check-h200.json"
  tail -n 12 $W/logs/d_deep_gemm.txt | cut -c1-250
  step graph-decode-h200-s9-mhc-norm 80 --requests 1,8 --not-yet
  step graph-decode-h200-s9-d-base 80 --requests 1,8
  step graph-decode-h200-s9-mhc-norm-no-prefetch 80 --requests 1,8 --not-yet --no-prefetch
}

part_e() {
  logged e_tests 80 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_mhc_norm.py
  tail -n 3 $W/logs/e_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/e_tests.txt | head -n 10 | cut -c1-300
  logged e_engine 420 python3 bench/engine_h200.py --static-decode --overlap --requests 1,8,64 --contexts 4096 \
    --modes none,dspark1,dspark2,dspark3,auto,auto_async --decode-only --steps 8 --confidence 0.8629 \
    --table-from-cells --budget-s 270 --peer --out "$OUT/engine-h200-s9.json"
  tail -n 30 $W/logs/e_engine.txt | cut -c1-300
}

part_f() {
  logged f_engine 330 python3 bench/engine_h200.py --static-decode --overlap --requests 1,8,64 --contexts 32768 \
    --modes none,dspark1,dspark2,dspark3,auto_async --decode-only --steps 8 --confidence 0.8629 \
    --table-from-cells --budget-s 270 --out "$OUT/engine-h200-s9-32k.json"
  tail -n 22 $W/logs/f_engine.txt | cut -c1-300
}

part_g() {
  logged g_tests 150 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_mhc.py \
    tests/kernels/test_mhc_norm.py "tests/kernels/test_cuda_graphs.py::test_mhc_ops_replay" \
    "tests/kernels/test_kernels_pdl.py::test_decode_chain_with_pdl_equals_without"
  tail -n 3 $W/logs/g_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/g_tests.txt | head -n 10 | cut -c1-300
  logged g_site 70 python3 bench/mhc_norm_site.py --dims 2048 --tiles "" --split-streams 0 \
    --out "$OUT/mhc-site-split-h200.json"
  grep -h '_us' $W/logs/g_site.txt | cut -c1-300
  step graph-decode-h200-s9-split 70 --requests 1,8
  step graph-profile-h200-s9-final-no-pdl 70 --requests 1 --no-pdl --profile
}

part_h() {
  logged h_tests 200 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_hc_head_norm.py \
    tests/kernels/test_hc_head_norm_model.py "tests/kernels/test_cuda_graphs.py::test_mhc_ops_replay" \
    tests/kernels/test_indexer_pool_fused.py tests/kernels/test_indexer_pool.py tests/kernels/test_lightning_indexer.py
  tail -n 3 $W/logs/h_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/h_tests.txt | head -n 10 | cut -c1-300
  step graph-decode-h200-hc-head 60 --requests 1,8 --not-yet
  step graph-decode-h200-hc-head-base 60 --requests 1,8
  step graph-decode-v41-mini-h200-pooled 60 --config v41-mini --requests 1,8 --not-yet
  step graph-decode-v41-mini-h200-pooled-base 60 --config v41-mini --requests 1,8
}

case "${1:?part: a, b, c, d, e, f, g or h}" in
  a) part_a ;;
  b) part_b ;;
  c) part_c ;;
  d) part_d ;;
  e) part_e ;;
  f) part_f ;;
  g) part_g ;;
  h) part_h ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
cp $W/logs/*.txt "$OUT/" 2>/dev/null || true
