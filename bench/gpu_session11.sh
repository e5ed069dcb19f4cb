#!/usr/bin/env bash
# GPU steps of the eleventh session, 2026-12-01 (each part < 9.5 min on one H200):
#
#   run(command="bash bench/gpu_session11.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session11.sh b")
#   run(command="bash bench/gpu_session11.sh d")
#   run(command="bash bench/gpu_session11.sh c")
#   run(command="PYTHONPATH=. python3 bench/engine_h200.py --static-decode --overlap --decode-only --steps 8
#       --confidence 0.8629 --table-from-cells --requests 256 --modes none,dspark1,dspark2,dspark3,auto_async
#       --contexts 4096|32768 --out $OUT/engine-h200-s11e-256[-32k].json")   # e: two calls, warm machine
#
# a: the tenth session's CPU-only work under its GPU tests: MTP-1 on the static slots (graphs replayed,
#    the default engine's tokens) and auto's budget-0 rounds (plain steps with the drafter observing);
#    then the per-op benches that did not fit last time: the 1-8-row GEMV against cuBLAS (sets
#    `linear.GEMV_MAX_ROWS`), the two-pass greedy argmax against torch.argmax, the DSpark propose graph.
# b: the engine over the issue's load grid after the tenth session's kernel merges, with MTP-1 on the
#    static path and auto able to choose plain rounds: 1 / 8 / 16 / 32 / 64 / 128 / 256 requests x none,
#    mtp1, dspark1-3, auto (round in flight), graphs + overlap, constant drafter confidence 0.8629
#    (budget 3 -> 3.25 tokens per round), at 4K (with HF eager at batch 1) and 32K.
# d: the GPU tests of static MTP as the default on CUDA (fp32 target, drafts compared round by round
#    with the dynamic drafter's); the graph steps after GEMV_MAX_ROWS = 4 (v4-mini at 1 / 8 requests,
#    its 4-token verify step, v41-mini with the 4-warp V4.1 statistics split), the one-request step's
#    kernel profile with PDL off, and the per-op benches of the tenth session's kernels (mHC
#    epilogues, latency-bound kernels).
# c: this session's engine changes under their GPU tests (auto's plain rounds trimmed and observing on
#    a side stream, sampled drafting from CUDA graphs, static MTP); the DSpark propose graphs (greedy and
#    sampled); the engine again with each timing converted at its own rounds (tau per loop): v4-mini
#    4K over the whole load grid (none, MTP-1, DSpark 3, auto), 32K at 64 / 128 / 256 requests, sampled
#    DSpark 3 (T = 1) from graphs vs eager at 1 / 8 / 64; the V4.1 analogue (v41-mini) with graphs at
#    1 / 8 / 64 / 256 requests, 4K. As run, its auto cells planned on tables of the none and DSpark-3
#    cells only (budgets 1 and 2 interpolated): engine_h200.py now refuses that; part e re-ran 256.
#
# Only 8 files come back from a call, so every part ends by packing $OUT into one session11-PART.tgz.
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack

part_a() {
  tests a_mtp 170 tests/engine/test_engine_static_gpu.py -k mtp
  tests a_zero 170 -m gpu tests/engine/test_engine_draft_lookahead_plain.py tests/engine/test_engine_draft_lookahead_auto.py \
    tests/engine/test_engine_draft_lookahead.py
  logged a_rows 90 python3 bench/linear_decode.py --no-sweep --rows 1,2,4,8 --out "$OUT/linear-rows-h200.json"
  tail -n 14 $W/logs/a_rows.txt | cut -c1-300
  logged a_argmax 35 python3 bench/argmax_rows.py --out "$OUT/argmax-rows-h200.json"
  tail -n 6 $W/logs/a_argmax.txt | cut -c1-300
  logged a_draft 60 python3 bench/graph_draft.py --requests 1,8 --out "$OUT/graph-draft-h200-s11.json"
  grep -h "^{" $W/logs/a_draft.txt | cut -c1-600; tail -n 2 $W/logs/a_draft.txt | cut -c1-200
}

part_b() {
  local grid=(--static-decode --overlap --requests 1,8,16,32,64,128,256 --modes none,mtp1,dspark1,dspark2,dspark3,auto_async
              --decode-only --steps 8 --confidence 0.8629 --table-from-cells)
  logged b_engine_4k 330 python3 bench/engine_h200.py "${grid[@]}" --contexts 4096 --budget-s 285 --peer \
    --out "$OUT/engine-h200-s11.json"
  tail -n 40 $W/logs/b_engine_4k.txt | cut -c1-300
  logged b_engine_32k 230 python3 bench/engine_h200.py "${grid[@]}" --contexts 32768 --budget-s 195 \
    --out "$OUT/engine-h200-s11-32k.json"
  tail -n 30 $W/logs/b_engine_32k.txt | cut -c1-300
}

part_c() {
  tests c_tests 130 -m gpu tests/engine/test_engine_draft_lookahead_plain.py tests/engine/test_engine_draft_lookahead_auto.py \
    tests/draft/test_static_draft_graph_gpu.py "tests/engine/test_engine_static_gpu.py::test_static_decode_sampled_dspark_rounds_run_and_free_their_slots" \
    "tests/engine/test_engine_static_gpu.py::test_static_mtp_rounds_replay_graphs_with_the_default_engine_tokens"
  logged c_draft 45 python3 bench/graph_draft.py --requests 1,8 --out "$OUT/graph-draft-h200-s11c.json"
  grep -h "^{" $W/logs/c_draft.txt | cut -c1-700; tail -n 2 $W/logs/c_draft.txt | cut -c1-200
  local grid=(--static-decode --overlap --decode-only --steps 8 --confidence 0.8629 --table-from-cells)
  logged c_engine_4k 165 python3 bench/engine_h200.py "${grid[@]}" --requests 1,8,16,32,64,128,256 \
    --modes none,mtp1,dspark3,auto_async --contexts 4096 --budget-s 145 --out "$OUT/engine-h200-s11c.json"
  tail -n 22 $W/logs/c_engine_4k.txt | cut -c1-300
  logged c_engine_32k 70 python3 bench/engine_h200.py "${grid[@]}" --requests 64,128,256 \
    --modes none,dspark3,auto_async --contexts 32768 --budget-s 55 --out "$OUT/engine-h200-s11c-32k.json"
  tail -n 12 $W/logs/c_engine_32k.txt | cut -c1-300
  logged c_sampled 55 python3 bench/engine_h200.py "${grid[@]}" --requests 1,8,64 \
    --modes dspark3_t1,dspark3_t1_eager --contexts 4096 --budget-s 40 --out "$OUT/engine-h200-s11c-sampled.json"
  tail -n 8 $W/logs/c_sampled.txt | cut -c1-300
  logged c_engine_v41 95 python3 bench/engine_h200.py "${grid[@]}" --config v41-mini --requests 1,8,64,256 \
    --modes none,dspark3,auto_async --contexts 4096 --budget-s 80 --out "$OUT/engine-v41-mini-h200-s11.json"
  tail -n 16 $W/logs/c_engine_v41.txt | cut -c1-300
}

part_d() {
  tests d_mtp 130 tests/engine/test_engine_static_gpu.py -k mtp
  step graph-decode-h200-s11 50 --requests 1,8
  step graph-verify-h200-s11 45 --requests 1 --tokens 4
  step graph-decode-v41-mini-h200-s11 55 --config v41-mini --requests 1,8
  step graph-profile-h200-s11-no-pdl 50 --requests 1 --no-pdl --profile
  logged d_epi 90 python3 bench/mhc_epilogue.py --out "$OUT/mhc-epilogue-h200.json"
  tail -n 6 $W/logs/d_epi.txt | cut -c1-300
  logged d_lat 80 python3 bench/latency_kernels.py --out "$OUT/latency-kernels-h200.json"
  tail -n 14 $W/logs/d_lat.txt | cut -c1-300
}

case "${1:?part: a to d}" in
  a) part_a ;;
  b) part_b ;;
  c) part_c ;;
  d) part_d ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
pack "session11-$1"
