#!/usr/bin/env bash
# GPU steps of the fourteenth session (each part < 9.5 min on one H200):
#
#   run(command="bash bench/gpu_session14.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session14.sh b", kind="nvidia-h200")
#   run(command="bash bench/gpu_session14.sh c", kind="nvidia-h200")
#   run(command="bash bench/gpu_session14.sh d", kind="nvidia-h200")
#
# a: the MoE kernel tests on the GPU (the tensor-core FP8 decode GEMV, the packed path's FP8 tiles
#    scaled after the dot) and the static drafter's GPU tests (their helpers were refactored after
#    their last GPU run); `bench/moe_fp8.py`: the FP8 decode GEMV on the CUDA cores (shipped) against
#    the tensor cores (swept), the packed path before / after, V4-Flash and v4-mini layers, 128x128
#    and 32x32 blocks; the sampled DSpark-3 cells at 64 requests, whose per-request verify calls are
#    now one batched call per round (not re-timed since).
# b: part a's tensor-core GEMV was 2x slower than the shipped one and its sweep ran out of time, so:
#    the packed path before / after alone, `bench/kernels.py`'s FP8 MoE rows (M = 1, 8, 64, 256: the
#    issue's "% of HBM roofline" figures), the MoE tests on FP8, decode and packed paths.
# c: neither part a's tensor-core GEMV nor part b's scale-after-dot won (both reverted); the FP8 decode
#    kernels again with wider reduction steps (up to whole rows: more bytes in flight per program), and
#    the sampled DSpark-3 cell at 64 requests with more time than part a gave it.
# d: with part c's shapes shipped (`moe_decode._MEASURED`): the same sweep (old and new shapes per
#    kernel, the whole op at the new shipped ones), `bench/kernels.py`'s FP8 MoE rows at M = 1, 8, and
#    the MoE tests on the GPU.
#
# Parts a and b call bench/moe_fp8.py, which the revert removed: re-run them at 3507663 / 9088fad.
#
# Only 8 files come back from a call, so the part ends by packing $OUT into one session14-PART.tgz.
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack, dispatch

part_a() {
  tests a_moe_tests 150 tests/kernels/test_moe.py
  logged a_moe_fp8 260 python3 bench/moe_fp8.py --out "$OUT/moe-fp8-h200.json"
  grep -h "decode:\|packed:\|rc=" $W/logs/a_moe_fp8.txt | cut -c1-330
  tail -n 3 $W/logs/a_moe_fp8.txt | cut -c1-300
  tests a_draft_tests 90 -m gpu tests/draft/test_static_draft_graph_gpu.py
  logged a_sampled 100 python3 bench/engine_h200.py --static-decode --overlap --decode-only --steps 8 --confidence 0.8629 \
    --requests 64 --modes dspark3,dspark3_t1 --contexts 4096 --budget-s 80 --out "$OUT/engine-h200-s14a-sampled.json"
  tail -n 8 $W/logs/a_sampled.txt | cut -c1-300
}

part_b() {
  logged b_moe_packed 120 python3 bench/moe_fp8.py --decode-tokens "" --out "$OUT/moe-fp8-packed-h200.json"
  grep -h "packed:\|rc=" $W/logs/b_moe_packed.txt | cut -c1-330
  logged b_kernels 220 python3 bench/kernels.py --configs flash,mini --ops fused_moe_fp8_128,fused_moe_fp8_32 \
    --tokens 1,8,64,256 --model-steps 0 --out "$OUT/kernels-moe-fp8-h200.json"
  tail -n 20 $W/logs/b_kernels.txt | cut -c1-250
  tests b_moe_tests 200 tests/kernels/test_moe.py -k "fp8 or decode or packed or mma"
}

part_c() {
  logged c_tiles 240 python3 bench/moe_decode_tiles.py --layers v4-flash,v4-mini --kinds fp8 --tokens 1,8 --graph \
    --fp8-steps 256,512,1024,2048 --rows 4,8,16,32 --out "$OUT/moe-decode-tiles-fp8-wide-h200.json"
  tail -n 6 $W/logs/c_tiles.txt | cut -c1-400
  logged c_sampled 230 python3 bench/engine_h200.py --static-decode --overlap --decode-only --steps 8 --confidence 0.8629 \
    --requests 64 --modes dspark3,dspark3_t1 --contexts 4096 --budget-s 200 --out "$OUT/engine-h200-s14c-sampled.json"
  tail -n 8 $W/logs/c_sampled.txt | cut -c1-300
}

part_d() {
  logged d_tiles 240 python3 bench/moe_decode_tiles.py --layers v4-flash,v4-mini --kinds fp8 --tokens 1,8 --graph \
    --fp8-steps 256,512,1024,2048 --rows 4,8,16,32 --out "$OUT/moe-decode-tiles-fp8-shipped-h200.json"
  tail -n 6 $W/logs/d_tiles.txt | cut -c1-400
  logged d_kernels 100 python3 bench/kernels.py --configs flash,mini --ops fused_moe_fp8_128,fused_moe_fp8_32 \
    --tokens 1,8 --model-steps 0 --out "$OUT/kernels-moe-fp8-d-h200.json"
  tail -n 10 $W/logs/d_kernels.txt | cut -c1-250
  tests d_moe_tests 150 tests/kernels/test_moe.py -k "fp8 or decode or packed"
}

dispatch session14 "${1:-}"
