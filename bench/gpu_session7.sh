#!/usr/bin/env bash
# GPU steps of the seventh 2026-11-30 session (each part < 9.5 min):
#
#   run(command="bash bench/gpu_session7.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session7.sh b")          # the suite hit tests/server's uvicorn import
#   run(command="bash bench/gpu_session7.sh suite")
#   run(command="bash bench/gpu_session7.sh c")
#   run(command="bash bench/gpu_session7.sh d")
#   run(command="bash bench/gpu_session7.sh next")    # written after the device time ran out: not run yet
#   run(command="bash bench/gpu_session7.sh next2")   # likewise
#
# a: the two kernels written last session after the device time ran out (registry.NOT_YET_ON_GPU:
#    `compressor_pool_gather`, `index_scores`): their GPU tests and the static steps that use them, the
#    step profile with them on, and the 32K engine cells (128 / 256 requests) where DSpark / none was
#    lowest, with them on.
# b: the not-yet kernels' tests past the test fixed after a (its 1 × 1 case had nothing visible, so its
#    error norm was 0 / 0), then the whole GPU-marked suite in one call, verbose, under a time limit.
set -uo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
W=/tmp/gpu-session && mkdir -p $W/logs

logged() {  # logged NAME TIMEOUT CMD...: run CMD under a timeout into $W/logs/NAME.txt, record rc
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$W/logs/$name.txt" 2>&1
  echo "$name rc=$?" | tee -a "$W/logs/$name.txt"
}

part_a() {
  logged a_tests 200 python3 -m pytest -q -p no:cacheprovider -rs -x tests/kernels/test_compressor_pool.py \
    tests/kernels/test_lightning_indexer.py tests/kernels/test_static_step_kernels.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py tests/engine/test_engine_static_gpu.py
  tail -n 8 $W/logs/a_tests.txt | cut -c1-400
  logged a_profile 110 python3 bench/graph_decode.py --requests 1,8,64 --not-yet --profile \
    --out "$OUT/graph-profile-h200-not-yet.json"
  grep -h "^{" $W/logs/a_profile.txt | cut -c1-500; tail -n 3 $W/logs/a_profile.txt | cut -c1-300
  logged a_32k 200 python3 bench/engine_h200.py --static-decode --overlap --not-yet --requests 128,256 \
    --modes none,dspark3 --contexts 32768 --decode-only --steps 4 --budget-s 160 --out "$OUT/engine-h200-32k-not-yet.json"
  grep -h '"mode"\|skip\|Error' $W/logs/a_32k.txt | cut -c1-220
}

part_b() {
  logged b_tests 120 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_lightning_indexer.py \
    tests/kernels/test_static_step_kernels.py tests/models/test_deepseek_v4_static_graph_gpu.py \
    tests/engine/test_engine_static_gpu.py
  tail -n 8 $W/logs/b_tests.txt | cut -c1-400
  part_suite
}

part_suite() {  # tests/server needs uvicorn, which the device's Python lacks (the server has no GPU-marked tests)
  logged b_gpu_suite 420 python3 -m pytest -v -p no:cacheprovider -rfs -m gpu --durations=20 --ignore=tests/server tests
  grep -c PASSED $W/logs/b_gpu_suite.txt; grep -h "FAILED\|ERROR\|passed\|failed" $W/logs/b_gpu_suite.txt | tail -n 25 | cut -c1-300
  cp $W/logs/b_gpu_suite.txt "$OUT/gpu-suite-h200-s7.log"
}

part_c() {  # where a 32K step's time goes (128 requests, one token each), the static step's ops on by default
  logged c_profile 300 python3 bench/graph_decode.py --requests 128 --context 32768 --profile \
    --out "$OUT/graph-profile-h200-32k.json"
  grep -h "^{" $W/logs/c_profile.txt | cut -c1-1500; tail -n 3 $W/logs/c_profile.txt | cut -c1-300
}

part_d() {  # the few-row linear kernels and the MoE pack kernel (helpers measured the pack and mHC parts)
  logged d_tests 170 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_linear.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py "tests/kernels/test_kernels_model.py::test_fused_matches_reference_on_gpu"
  tail -n 8 $W/logs/d_tests.txt | cut -c1-400
  logged d_linear 70 python3 bench/linear_decode.py --no-sweep --out "$OUT/linear-decode-h200.json"
  grep -h '"rows": 1,\|"rows": 8,' $W/logs/d_linear.txt | cut -c1-260
  logged d_pack 50 python3 bench/moe_pack.py --out "$OUT/moe-pack-h200.json"
  grep -h '"moe"\|8190' $W/logs/d_pack.txt | cut -c1-200
  logged d_profile 110 python3 bench/graph_decode.py --requests 1,8,64 --not-yet --profile \
    --out "$OUT/graph-profile-h200-linear.json"
  grep -h "graph_ms\|launches" $W/logs/d_profile.txt | cut -c1-330; tail -n 2 $W/logs/d_profile.txt | cut -c1-200
}

part_next() {  # compressor_project (NOT_YET_ON_GPU), the shipped GEMV policy, DSpark rounds in flight, the engine
  logged next_tests 230 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_linear.py \
    tests/engine/test_engine_draft_lookahead.py tests/kernels/test_cache_round.py \
    "tests/kernels/test_kernels_model.py::test_fused_matches_reference_on_gpu" tests/models/test_deepseek_v4_static_graph_gpu.py
  tail -n 6 $W/logs/next_tests.txt | cut -c1-400
  logged next_linear 70 python3 bench/linear_decode.py --no-sweep --out "$OUT/linear-decode-project-h200.json"
  grep -h '"project"' $W/logs/next_linear.txt | cut -c1-260
  logged next_kernels 90 python3 bench/kernels.py --ops linear_wkv,compressor_project,index_scores --model-steps 0 \
    --out "$OUT/kernels-s7-h200.json"
  tail -n 12 $W/logs/next_kernels.txt | cut -c1-200
}

part_next2() {
  logged next_profile 110 python3 bench/graph_decode.py --requests 1,8,64 --not-yet --profile \
    --out "$OUT/graph-profile-h200-project.json"
  grep -h "graph_ms" $W/logs/next_profile.txt | cut -c1-330
  logged next_v41 90 python3 bench/graph_decode.py --config v41-mini --requests 1,8 --not-yet --profile \
    --out "$OUT/graph-profile-v41-mini-h200-s7.json"   # cache_round: V4.1's QAT rounding in one launch per call
  grep -h "graph_ms" $W/logs/next_v41.txt | cut -c1-330
  # DSpark 3 rounds now run one in flight too (draft_lookahead.py): the dspark3 cells time that.
  logged next_engine 200 python3 bench/engine_h200.py --static-decode --overlap --not-yet --requests 1,8,64 \
    --modes none,dspark3 --contexts 4096 --decode-only --peer --steps 8 --budget-s 170 --out "$OUT/engine-h200-s7.json"
  grep -h '"mode"' $W/logs/next_engine.txt | cut -c1-220
}

part_$1
tar -C $W -cf "$OUT/logs7-$1.tar" logs
ls -la "$OUT"
