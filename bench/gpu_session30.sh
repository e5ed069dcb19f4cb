#!/usr/bin/env bash
# GPU steps of the twenty-ninth session, for one H100 or H200 (every JSON names its card). All ran in
# that session, each call on an H100 (results *-h100-s29*; the first asked for an H200):
#
#   run(command="bash bench/gpu_session29.sh c; bash bench/gpu_session30.sh a", kind="nvidia-h200",
#       carry=[".whl"])                                             # ≈ 2 min
#   git show 284cc41:dspark/kernels/mhc_v41.py > .ab/mhc_v41_old.py   # on this machine first
#   run(command="bash bench/gpu_session30.sh b", carry=[".ab"])    # ≈ 6 min
#   run(command="bash bench/gpu_session30.sh c")                   # ≈ 3 min
#   run(command="bash bench/gpu_session30.sh d")                   # ≈ 4 min
#   run(command="bash bench/gpu_session30.sh e")                   # ≈ 4 min
#
# a: the v4-mini graph step at one request profiled without PDL (per-kernel attribution: launches and
#    µs per kernel name), the launch list the next fusions of issue 7 pick from.
# b: with `moe_route_rows` on by default and V4.1's mHC split over the streams up to 32 tokens (it was
#    8; `bench/gpu_session29.sh b`: 13.3 -> 7.7 µs per site at 16 tokens, 13.6 -> 9.3 at 32): the GPU
#    tests of mhc_v41 (real shapes now include 32 tokens) and of V4.1's static graph, then the v41-mini
#    graph step at 4 and 8 requests with 4-token verify blocks (16 and 32 rows, `--image-token-id 7`)
#    with mhc_v41.py as committed and as it was (`.ab/mhc_v41_old.py`), twice in alternation.
# c: the Sinkhorn's share of an mHC site: V4.1's site (`bench/mhc_v41_site.py`) and V4's folded and
#    unfolded sites (`bench/mhc_norm_site.py`) at 1, 4 and 8 tokens with 20 Sinkhorn iterations (the
#    models') and with 1 (`--sinkhorn-iters`): what moving the mixes off the critical path (a side stream
#    beside the sublayer; only the next site reads post and comb) could save per site. Then V4's
#    static-graph GPU tests, which part a of gpu_session29.sh did not reach.
# d: with V4.1's mHC mixes on a third side stream (`side_stream.MIX`, part c's Sinkhorn share): the GPU
#    tests of mhc_v41 (the epilogue in two launches against one, bit for bit) and of both static graphs
#    (3, 2, 1 and 0 lanes bit for bit, eager and replayed), then the v41-mini graph step at 1 and 8
#    requests with 3, 2, 1 and 0 side streams timed in turn in one process (`--side-ab`).
# e: V4's folded mHC sites (up to 4 rows) with post and comb on the MIX lane too: the GPU tests of
#    mhc_norm (the row epilogue in two launches against one, bit for bit) and of both static graphs
#    (V4 at 2 slots x 2 tokens there), then the v4-mini graph step at 1 and 4 requests with 3, 2, 1
#    and 0 side streams timed in turn in one process (`--side-ab`).
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, step, swap

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  step a_v4_profile 150 --requests 1 --profile --no-pdl
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests b_tests 200 tests/kernels/test_mhc_v41.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  local round side
  for round in 1 2; do
    for side in new old; do
      swap "$side" dspark/kernels/mhc_v41.py
      step "b_v41_verify_${side}_$round" 100 --config v41-mini --requests 4,8 --tokens 4 --image-token-id 7
    done
    swap new dspark/kernels/mhc_v41.py
  done
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  local iters
  for iters in 20 1; do
    logged "c_v41_iters$iters" 120 python3 bench/mhc_v41_site.py --tokens 1,4,8 --block-d "" --sinkhorn-iters "$iters" \
      --out "$OUT/c_v41_iters$iters.json"
    grep -h '"unsplit_us' "$W/logs/c_v41_iters$iters.txt" | cut -c1-300
    logged "c_v4_iters$iters" 120 python3 bench/mhc_norm_site.py --tokens 1,4,8 --dims 2048 --tiles "" \
      --sinkhorn-iters "$iters" --out "$OUT/c_v4_iters$iters.json"
    grep -h "unfused_us" "$W/logs/c_v4_iters$iters.txt" | cut -c1-300
  done
  tests c_tests 150 tests/models/test_deepseek_v4_static_graph_gpu.py
}

part_d() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests d_tests 240 tests/kernels/test_mhc_v41.py tests/models/test_deepseek_v4_static_graph_gpu.py \
    tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  step d_v41_lanes 200 --config v41-mini --requests 1,8 --side-ab
  grep -h "side_streams\"\|mix_lane" "$W/logs/d_v41_lanes.txt" | cut -c1-600
}

part_e() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests e_tests 200 tests/kernels/test_mhc_norm.py tests/models/test_deepseek_v4_static_graph_gpu.py
  step e_v4_lanes 150 --requests 1,4 --side-ab
}

dispatch session30 "${1:-}"
