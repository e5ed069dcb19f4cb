#!/usr/bin/env bash
# GPU steps left by the eleventh session (written then, not run; each part < 9.5 min on one H200):
#
#   run(command="bash bench/gpu_session12.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session12.sh b", kind="nvidia-h200")
#   run(command="bash bench/gpu_session12.sh c", kind="nvidia-h200")
#   run(command="bash bench/gpu_session12.sh d", kind="nvidia-h200")
#   run(command="bash bench/gpu_session12.sh e", kind="nvidia-h200")
#   run(command="bash bench/gpu_session12.sh f", kind="nvidia-h200")
#
# a: the mixed sampled / greedy DSpark engine test on the sampled propose graphs with an fp32 target
#    (it failed in bf16); the engine's sampled cells (every request at T = 1, budget 3) drafting from the
#    sampled graphs against the eager sampled propose at 1 / 8 / 64 requests, 4K; v41-mini's auto /
#    best fixed budget with a full table at 64 / 128 / 256 requests, 4K (the eleventh session gave it a
#    two-point table); the v41-mini step's kernel profile at one request (1.9x v4-mini's step).
# b: where a DSpark-3 round at 64 requests (4K) spends its time: the greedy propose graph's kernel
#    profile, and the target's graph step with 4 tokens (the verify block) and 1 token per request.
# c: the mHC statistics pass's launch shapes at 64 / 256 / 320 tokens (part b: 57 us per call at 256
#    tokens against 10.5 at 64, the largest kernel of the verify step).
# d: the verify step again with part c's mHC tiles; the V4.1 statistics tiles at 64 / 256 tokens.
# e: the engine grid at 4K after both mHC tile changes and the trimmed propose (n_draft), every fixed
#    budget beside auto (a full capacity table); the propose graph at 64 requests drafting 3 of 5 slots.
# f: GPU tests of the changed kernels and the trimmed drafter; v41-mini's grid at 64 / 128 requests.
#
# Only 8 files come back from a call, so the part ends by packing $OUT into one session12-PART.tgz.
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack

part_a() {
  tests a_sampled 100 -m gpu "tests/engine/test_engine_static_gpu.py::test_static_decode_sampled_dspark_rounds_run_and_free_their_slots"
  local grid=(--static-decode --overlap --decode-only --steps 8 --confidence 0.8629)
  logged a_engine_sampled 90 python3 bench/engine_h200.py "${grid[@]}" --requests 1,8,64 \
    --modes dspark3_t1,dspark3_t1_eager --contexts 4096 --budget-s 75 --out "$OUT/engine-h200-s12-sampled.json"
  tail -n 10 $W/logs/a_engine_sampled.txt | cut -c1-300
  logged a_engine_v41 200 python3 bench/engine_h200.py "${grid[@]}" --table-from-cells --config v41-mini \
    --requests 64,128,256 --modes none,dspark1,dspark2,dspark3,auto_async --contexts 4096 --budget-s 180 \
    --out "$OUT/engine-v41-mini-h200-s12.json"
  tail -n 16 $W/logs/a_engine_v41.txt | cut -c1-300
  step graph-profile-v41-mini-h200-s12-no-pdl 60 --config v41-mini --requests 1 --no-pdl --profile
}

part_b() {
  logged b_draft 150 python3 bench/graph_draft.py --requests 64 --profile --no-pdl --out "$OUT/graph-draft-h200-s12-b64.json"
  grep -h "graph_ms\|propose_profile" $W/logs/b_draft.txt | cut -c1-1500
  step graph-profile-h200-s12-b64x4 120 --requests 64 --tokens 4 --no-pdl --profile
  step graph-profile-h200-s12-b64x1 120 --requests 64 --no-pdl --profile
}

part_c() {
  logged c_sweep 400 python3 bench/decode_sweep.py --mhc-tokens 64,256,320 --out "$OUT/mhc-stats-tokens-h200.json"
  grep -h "^mhc_stats\|rc=" $W/logs/c_sweep.txt
}

part_d() {
  step graph-profile-h200-s12-d64x4 120 --requests 64 --tokens 4 --no-pdl --profile
  logged d_v41 200 python3 bench/mhc_v41_site.py --tokens 64,256 --unsplit-variants --reps 100 \
    --block-d 64/32/4,64/32/4/32,32/16/4/32,32/32/4/64,32/16/4/64,64/32/4/64,64/16/4/64 --out "$OUT/mhc-v41-tokens-h200.json"
  grep -h "_us" $W/logs/d_v41.txt | cut -c1-900
}

part_e() {
  logged e_engine 420 python3 bench/engine_h200.py --static-decode --overlap --decode-only --steps 8 --confidence 0.8629 \
    --table-from-cells --requests 1,8,64,128,256 --modes none,dspark1,dspark2,dspark3,auto_async --contexts 4096 \
    --budget-s 380 --out "$OUT/engine-h200-s12e.json"
  tail -n 30 $W/logs/e_engine.txt | cut -c1-300
  logged e_draft 100 python3 bench/graph_draft.py --requests 64 --n-draft 3 --out "$OUT/graph-draft-h200-s12e-n3.json"
  grep -h "graph_ms" $W/logs/e_draft.txt | cut -c1-700
}

part_f() {
  tests f_tests 240 -m gpu tests/kernels/test_mhc.py tests/kernels/test_mhc_v41.py tests/kernels/test_mhc_norm.py \
    tests/draft/test_static_draft_graph_gpu.py tests/engine/test_engine_static_gpu.py
  logged f_v41 200 python3 bench/engine_h200.py --config v41-mini --static-decode --overlap --decode-only --steps 8 \
    --confidence 0.8629 --requests 64,128 --modes none,dspark3 --contexts 4096 --budget-s 180 \
    --out "$OUT/engine-v41-mini-h200-s12f.json"
  tail -n 12 $W/logs/f_v41.txt | cut -c1-300
}

case "${1:?part: a to f}" in
  a) part_a ;;
  b) part_b ;;
  c) part_c ;;
  d) part_d ;;
  e) part_e ;;
  f) part_f ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
pack "session12-$1"
