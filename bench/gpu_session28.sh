#!/usr/bin/env bash
# GPU steps of the twenty-eighth session, for one H100 or H200 (every JSON names its card):
#
#   run(command="bash bench/gpu_session27.sh d")   # ≈ 8 min: ran first this session (results *-s28*)
#   run(command="bash bench/gpu_session28.sh a")   # ≈ 1 min (ran on an H200)
#   git show a612888:dspark/kernels/mhc_v41.py > .ab/mhc_v41_old.py   # on this machine first
#   run(command="bash bench/gpu_session28.sh b", carry=[".ab"])   # ≈ 5 min (ran on an H200)
#   git show a612888:dspark/kernels/mhc.py > .ab/mhc_old.py   # part c's .ab (replaces b's)
#   run(command="bash bench/gpu_session28.sh c", carry=[".ab"])   # ≈ 6 min (got an H100)
#   git show a76a0c4:dspark/kernels/mhc.py > .ab/mhc_old.py   # part d's .ab
#   run(command="bash bench/gpu_session28.sh d", carry=[".ab"])   # ≈ 3 min (ran as its three calls, on
#                                                                  # one H100, the device time nearly spent)
#
# a: the V4.1 single-pass mHC site's statistics tiles at 1, 4 and 8 tokens (`bench/mhc_v41_site.py`,
#    24 sites per graph): the shipped decode tiles (pre / post_pre D-blocks 64 / 32, 4 warps at ≤ 4
#    tokens) against wider D-blocks (fewer programs and fewer partials for the epilogue to reduce) and
#    other warp counts, on the card the v41-mini profile (`v41-profile-h100-s28.json`) came from: there
#    the statistics pass takes 8.5 µs and the epilogue 6.0 µs per site at one token (PDL off).
# b: with part a's pick shipped (64-wide D-blocks at both sites, 4 warps, the split up to 8 tokens): the
#    GPU tests of mhc_v41 and of V4.1's static graph; V4's folded mHC sites (v4-mini) at 1, 4 and 8
#    tokens with its split programs' warps varied (`bench/mhc_norm_site.py --stats-warps`: shipped 4 / 8
#    for pre / post_pre, split up to 4 tokens); the v41-mini graph step at 1 and 8 requests with
#    mhc_v41.py as committed and as it was (`.ab/mhc_v41_old.py`), twice in alternation.
# c: with part b's V4 pick shipped (the post_pre site's split statistics programs at 4 warps, not 8):
#    the GPU tests of mhc, mhc_norm, mhc_v41 and both static graphs; the v4-mini graph step at 1 and 8
#    requests with mhc.py as committed and as it was (`.ab/mhc_old.py`), twice in alternation.
# d: V4's unfolded mHC sites (the model folds the norm only up to 4 tokens) with the statistics split
#    over the streams above 4 tokens (`bench/mhc_norm_site.py --split-streams 8,16` at 8 and 16 tokens),
#    then, with the split up to 16 tokens shipped, the v4-mini graph step at 8 requests with mhc.py as
#    committed and as it was (`.ab/mhc_old.py`), twice in alternation.
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, step, swap, ab_steps

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged a_site 300 python3 bench/mhc_v41_site.py --tokens 1,4,8 --reps 300 \
    --block-d 64/32/4,128/64/4,128/128/4,64/64/4,256/128/4,256/256/4,128/64/8,256/256/8,64/32/2,128/64/2,32/32/4 \
    --out "$OUT/a_site.json"
  tail -n 30 "$W/logs/a_site.txt" | cut -c1-400
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests b_tests 200 tests/kernels/test_mhc_v41.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  logged b_v4_site 200 python3 bench/mhc_norm_site.py --tokens 1,4,8 --dims 2048 --tiles "" \
    --stats-warps 4/8,4/4,4/8/8,4/4/8,8/8 --out "$OUT/b_v4_site.json"
  grep -h '"time"\|_us' "$W/logs/b_v4_site.txt" | tail -n 3 | cut -c1-700
  ab_steps b 0 dspark/kernels/mhc_v41.py
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests c_tests 200 tests/kernels/test_mhc.py tests/kernels/test_mhc_norm.py tests/kernels/test_mhc_v41.py \
    tests/models_v41/test_deepseek_v41_static_graph_gpu.py tests/models/test_deepseek_v4_static_graph_gpu.py
  local round side
  for round in 1 2; do
    for side in new old; do
      swap "$side" dspark/kernels/mhc.py
      step "c_v4_${side}_$round" 80 --requests 1,8
    done
    swap new dspark/kernels/mhc.py
  done
}

part_d() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged d_site 150 python3 bench/mhc_norm_site.py --tokens 8,16 --dims 2048 --reps 100 --tiles "" \
    --split-streams 8,16 --out "$OUT/d_site.json"
  grep -h "unfused_us" "$W/logs/d_site.txt" | cut -c1-400
  local round side
  for round in 1 2; do
    for side in new old; do
      swap "$side" dspark/kernels/mhc.py
      step "d_v4_${side}_$round" 70 --requests 8
    done
    swap new dspark/kernels/mhc.py
  done
}

dispatch session28 "${1:-}"
