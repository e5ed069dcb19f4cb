#!/usr/bin/env bash
# GPU steps of the eighth 2026-11-30 session (each part < 9.5 min):
#
#   run(command="bash bench/gpu_session8.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session8.sh b")
#   run(command="bash bench/gpu_session8.sh c")
#   run(command="bash bench/gpu_session8.sh d")
#
# a: last session's fixes (cache_round's div_rn and saturating reference, DraftLookahead's copy of the
#    propose outputs) under their GPU tests; the decode MoE's launch shapes swept on v4-mini's layer as
#    CUDA-graph replays (the shipped ones were picked on V4-Flash's); the v41-mini step with cache_round.
source "$(dirname "$0")/gpu_lib.sh"  # logged NAME TIMEOUT CMD...

part_a() {
  logged a_tests 220 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_cache_round.py \
    tests/engine/test_engine_draft_lookahead.py tests/kernels/test_linear.py \
    "tests/kernels/test_kernels_model.py::test_fused_matches_reference_on_gpu"
  tail -n 6 $W/logs/a_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/a_tests.txt | head -n 20 | cut -c1-300
  logged a_moe 200 python3 bench/moe_decode_tiles.py --layers v4-mini --wide --graph --out "$OUT/moe-decode-tiles-mini-h200.json"
  grep -h "fp8=" $W/logs/a_moe.txt | cut -c1-400
  logged a_v41 100 python3 bench/graph_decode.py --config v41-mini --requests 1,8 --not-yet --profile \
    --out "$OUT/graph-profile-v41-mini-h200-s8.json"   # cache_round: V4.1's QAT rounding in one launch per call
  grep -h "graph_ms" $W/logs/a_v41.txt | cut -c1-330; tail -n 2 $W/logs/a_v41.txt | cut -c1-200
}

# b: the sparse attention's chunking (`min_chunk_tiles` 1 / 2 / 4) and the FP8 decode GEMV over several
#    scale blocks per step: their tests, then timed as graph replays.
part_b() {
  logged b_tests 150 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_moe.py tests/kernels/test_sparse_attention.py
  tail -n 4 $W/logs/b_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/b_tests.txt | head -n 20 | cut -c1-300
  logged b_attn 80 python3 bench/attn_decode_chunks.py --out "$OUT/attn-decode-chunks-h200.json"
  grep -h "^{" $W/logs/b_attn.txt | cut -c1-200
  logged b_fp8 150 python3 bench/moe_decode_tiles.py --layers v4-flash,v4-mini --kinds fp8 --tokens 1 --wide --graph \
    --out "$OUT/moe-decode-tiles-fp8-h200.json"
  grep -h "fp8=" $W/logs/b_fp8.txt | cut -c1-400
}

# c: this session's static-step changes (fewer index ops, state written by the kernels that make it) and
#    PDL under the GPU tests, then the step with everything on by default, and once more at one request
#    with PDL off (the A/B).
part_c() {
  logged c_tests 200 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_kernels_pdl.py \
    tests/kernels/test_compressor_pool.py tests/kernels/test_linear.py tests/kernels/test_static_step_kernels.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py tests/models/test_deepseek_v4_step_index.py \
    tests/models_v41/test_deepseek_v41_static_graph_gpu.py tests/engine/test_engine_static_gpu.py \
    "tests/kernels/test_kernels_model.py::test_fused_matches_reference_on_gpu"
  tail -n 4 $W/logs/c_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/c_tests.txt | head -n 20 | cut -c1-300
  logged c_profile 120 python3 bench/graph_decode.py --requests 1,8,64 --profile --out "$OUT/graph-profile-h200-s8.json"
  grep -h "graph_ms" $W/logs/c_profile.txt | cut -c1-330; tail -n 2 $W/logs/c_profile.txt | cut -c1-200
  logged c_nopdl 90 python3 bench/graph_decode.py --requests 1,8 --no-pdl --out "$OUT/graph-decode-h200-s8-no-pdl.json"
  grep -h "graph_ms" $W/logs/c_nopdl.txt | cut -c1-330
}

# d: the GPU tests that part c's time limit cut off (its first 200 s ran the PDL, pool, linear and
#    static-kernel tests: one CPU-only test failed there, fixed), then the engine with everything on by
#    default, the HF peer in the same run.
part_d() {
  logged d_tests 140 python3 -m pytest -q -p no:cacheprovider -rs \
    "tests/kernels/test_kernels_pdl.py::test_each_launch_asks_pdl_launch_for_its_own_grid" \
    tests/models/test_deepseek_v4_static_graph_gpu.py tests/models/test_deepseek_v4_step_index.py \
    tests/models_v41/test_deepseek_v41_static_graph_gpu.py tests/engine/test_engine_static_gpu.py \
    "tests/kernels/test_kernels_model.py::test_fused_matches_reference_on_gpu"
  tail -n 4 $W/logs/d_tests.txt | cut -c1-400; grep -h "^E  \|FAILED" $W/logs/d_tests.txt | head -n 20 | cut -c1-300
  logged d_engine 220 python3 bench/engine_h200.py --static-decode --overlap --requests 1,8,64 \
    --modes none,dspark3 --contexts 4096 --decode-only --peer --steps 8 --budget-s 190 --out "$OUT/engine-h200-s8.json"
  grep -h '"mode"\|summary' $W/logs/d_engine.txt | cut -c1-260; tail -n 3 $W/logs/d_engine.txt | cut -c1-300
}

part_$1
tar -C $W -cf "$OUT/logs8-$1.tar" logs
ls -la "$OUT"
