#!/usr/bin/env bash
# GPU steps of the thirteenth session (each part < 9.5 min on one H200). The session first ran
# `bash bench/gpu_session12.sh e` and `f` (the twelfth session's parts, unrun then), then:
#
#   run(command="bash bench/gpu_session13.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session13.sh b", kind="nvidia-h200")
#   run(command="bash bench/gpu_session13.sh c", kind="nvidia-h200")
#   run(command="bash bench/gpu_session13.sh d", kind="nvidia-h200")
#
# a: the GPU tests of auto's rounds in flight (which now draft their budget, one slot past it every
#    fourth round), of the narrower propose graphs and of the fused greedy Markov step (now the
#    drafter's greedy slot on CUDA); the Markov step's timings and a short tile sweep; the engine grid
#    at 4K (every fixed budget beside auto: a full capacity table).
# b: the Markov step's GPU tests and timings again with the tiles part a's sweep chose; the grid at 32K
#    for 64 / 256 requests; the sampled DSpark-3 cells (every request at T = 1)
#    from the sampled propose graphs against the eager propose (the twelfth session's did not come back).
# c: 256 requests at 32K again (part b's 32K grid ran out of its time in that load's auto cell).
# d: where a round's time goes at 64 requests (4K), device kernels and host functions: plain, the fixed
#    budgets, auto (its synchronous steps trail DSpark 3 by 13 %) and DSpark 3 with every request at
#    T = 1 (4.4x a greedy round in part b).
#
# Only 8 files come back from a call, so the part ends by packing $OUT into one session13-PART.tgz.
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack
grid=(--static-decode --overlap --decode-only --steps 8 --confidence 0.8629 --table-from-cells
      --modes none,dspark1,dspark2,dspark3,auto_async)

part_a() {
  tests a_tests 130 -m gpu tests/engine/test_engine_draft_lookahead_auto.py tests/engine/test_engine_draft_lookahead_plain.py \
    tests/draft/test_static_draft_graph_gpu.py tests/kernels/test_markov_greedy.py
  logged a_markov 120 python3 bench/markov_greedy.py --sweep --sweep-seconds 15 --out "$OUT/markov-greedy-h200.json"
  tail -n 24 $W/logs/a_markov.txt | cut -c1-300
  logged a_engine 290 python3 bench/engine_h200.py "${grid[@]}" --requests 1,8,64,128,256 --contexts 4096 \
    --budget-s 260 --out "$OUT/engine-h200-s13a.json"
  tail -n 30 $W/logs/a_engine.txt | cut -c1-300
}

part_b() {
  tests b_tests 60 -m gpu tests/kernels/test_markov_greedy.py
  logged b_markov 60 python3 bench/markov_greedy.py --out "$OUT/markov-greedy-h200-b.json"
  tail -n 6 $W/logs/b_markov.txt | cut -c1-300
  logged b_engine_32k 160 python3 bench/engine_h200.py "${grid[@]}" --requests 64,256 --contexts 32768 \
    --budget-s 140 --out "$OUT/engine-h200-s13b-32k.json"
  tail -n 16 $W/logs/b_engine_32k.txt | cut -c1-300
  logged b_sampled 100 python3 bench/engine_h200.py --static-decode --overlap --decode-only --steps 8 --confidence 0.8629 \
    --requests 1,8,64 --modes dspark3_t1,dspark3_t1_eager --contexts 4096 --budget-s 80 --out "$OUT/engine-h200-s13b-sampled.json"
  tail -n 12 $W/logs/b_sampled.txt | cut -c1-300
}

part_c() {
  logged c_256_32k 200 python3 bench/engine_h200.py "${grid[@]}" --requests 256 --contexts 32768 \
    --budget-s 170 --out "$OUT/engine-h200-s13c-256-32k.json"
  tail -n 40 $W/logs/c_256_32k.txt | cut -c1-250
}

part_d() {
  logged d_profile 230 python3 bench/engine_h200.py --static-decode --overlap --decode-only --steps 8 --confidence 0.8629 \
    --table-from-cells --modes none,dspark1,dspark2,dspark3,auto_async,dspark3_t1 --requests 64 --contexts 4096 --profile \
    --budget-s 200 --out "$OUT/engine-h200-s13d-profile.json"
  tail -n 30 $W/logs/d_profile.txt | cut -c1-250
}

case "${1:?part: a, b, c or d}" in
  a) part_a ;;
  b) part_b ;;
  c) part_c ;;
  d) part_d ;;
  *) echo "unknown part $1" >&2; exit 2 ;;
esac
pack "session13-$1"
