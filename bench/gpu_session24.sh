#!/usr/bin/env bash
# GPU steps of the twenty-fourth session, after side streams became the static step's default
# (`side_stream.DEFAULT_LANES` = 2), for one H200 (the issues' card; an H100 runs them too, its card
# named in every JSON):
#
#   run(command="bash bench/gpu_session24.sh b")                       # ≈ 2 min (at its commit, below)
#   run(command="bash bench/gpu_session24.sh a", kind="nvidia-h200")   # ≈ 7 min
#   run(command="bash bench/gpu_session22.sh c", kind="nvidia-h200")   # ≈ 4 min, H200 only
#   run(command="bash bench/gpu_session24.sh c")                       # ≈ 5 min
#
# a: the batch-1 graph step with 2 / 1 / 0 side streams on this card (`graph_decode.py --side-ab`,
#    v4-mini at 1 and 8 requests), then the engine table of the sixteenth session's part b with the
#    lanes on (`engine_h200.py`, 1 and 64 requests, 4K, no speculation / MTP-1 / DSpark 1-3 / auto, the
#    HF eager peer in the same call): % of the HBM roofline at batch 1, × HF, DSpark 3 / none at 64.
# b: (ran at 3f73b79, whose `wo_ab` it measured: no gain, so it was taken out and this part no longer runs)
#    wo_a and wo_b as one op (`grouped_wo_a.wo_ab`: the decode runs' partials summed in wo_b's GEMV
#    loads, one launch fewer per layer; `registry.NOT_YET_ON_GPU` until this has run): its GPU tests,
#    then the v4-mini graph step at 1 and 8 requests without it and with it (`--triton wo_ab`), twice
#    in alternation (separate processes).
# c: the side streams where the step is wide (their default is on for every step size): 2 / 1 / 0 lanes
#    at 64 and 256 requests, the 4-token verify block at 64, v41-mini at 64 (4K context).
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  step a_side 160 --requests 1,8 --side-ab
  logged a_engine 360 python3 bench/engine_h200.py --static-decode --overlap --decode-only --peer --steps 8 \
    --confidence 0.8629 --table-from-cells --modes none,mtp1,dspark1,dspark2,dspark3,auto_async --requests 1,64 \
    --contexts 4096 --budget-s 300 --out "$OUT/engine-s24.json"
  tail -n 16 "$W/logs/a_engine.txt" | cut -c1-300
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests b_tests 150 tests/kernels/test_grouped_wo_a.py tests/kernels/test_linear.py -m gpu
  for round in 1 2; do
    step "b_held_$round" 100 --requests 1,8
    step "b_wo_ab_$round" 100 --requests 1,8 --triton wo_ab
  done
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  step c_side_wide 200 --requests 64,256 --side-ab
  step c_side_verify_64 120 --requests 64 --tokens 4 --side-ab
  step c_side_v41_64 120 --config v41-mini --requests 64 --side-ab
}

dispatch session24 "${1:-}"
