#!/usr/bin/env bash
# GPU steps of the thirty-sixth session, for one H200 (an H100 runs them too; every JSON names its card).
# Parts a and c ran in the thirty-seventh session (bench/README.md); the code they time (the shared expert
# aside, bench/moe_aside_diag.py, DecodeTiles.down_maxnreg) was then taken out: run them at commit 8eb847e.
#
#   run(command="bash bench/gpu_session38.sh a")   # ≈ 4 min (5 at most)
#   run(command="bash bench/gpu_session38.sh b")   # ≈ 3 min: a's diagnosis alone, for a short budget
#   run(command="bash bench/gpu_session38.sh c")   # ≈ 4 min
#
# a: the shared expert aside's GPU tests (`gpu_session37.sh a` ran out of its 150 s before them), then
#    `bench/moe_aside_diag.py`: why the aside timed slower than in line (PDL variants, a kernel timeline).
# c: the decode down kernel's register cap (`DecodeTiles.down_maxnreg`; ptxas settles the FP8 8-token
#    V4-Flash shapes at 128 registers with an 8-byte spill, which a cap of 168 removes in the sm_90
#    compile): its GPU test, then `bench/moe_decode_tiles.py --split-ab --maxnreg` at those shapes
#    (issue 6's FP8 32×32 8-token row is at 58 % of HBM, target 60 %).
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, pack, dispatch

diag() {  # diag PART: bench/moe_aside_diag.py, its timings and timelines shown
  logged "$1_diag" 240 python3 bench/moe_aside_diag.py --out "$OUT/moe-aside-diag-$(card)-s36.json"
  grep -v "^ \"\|^{$\|^}$" "$W/logs/$1_diag.txt" | cut -c1-700
}

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests a_tests 60 --tb=line tests/kernels/test_moe.py tests/kernels/test_cuda_graphs.py -k "aside or join or shared"
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  diag a
}

part_b() { nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1; diag b; }

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests c_tests 60 --tb=line tests/kernels/test_moe.py -k "register_cap"
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  logged c_maxnreg 240 python3 bench/moe_decode_tiles.py --split-ab --layers v4-flash --kinds fp8,fp8-32 \
    --tokens 8 --splits 4 --maxnreg 168,200 --out "$OUT/moe-maxnreg-ab-flash-m8-$(card)-s36.json"
  grep -h "maxnreg=" "$W/logs/c_maxnreg.txt" | cut -c1-200
}

dispatch session38 "${1:-}"
