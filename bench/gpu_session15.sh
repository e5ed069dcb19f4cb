#!/usr/bin/env bash
# GPU steps prepared in the fourteenth session for the next one (not yet run; each part < 9.5 min on
# one H200):
#
#   run(command="bash bench/gpu_session15.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session15.sh b", kind="nvidia-h200")
#
# a: the GPU tests of what the fourteenth session wrote after its device time ran out (the decode MoE's
#    step functions and pipelined loops, auto's plain probe, MTP rounds in flight, the V4.1 stages, the
#    capacity plain curve, the static drafters' hashed sampling noise and its `slot_noise` kernel, which
#    stays in NOT_YET_ON_GPU until this passes); the decode MoE sweep with the software-pipelined loops (`--stages`) beside
#    the shipped shapes (which also re-times the shipped path after its refactor into step functions);
#    the packed MoE tile sweep (FP8 128x128 / 32x32, bf16).
# b: the engine at 1 / 64 requests, 4K: none, MTP-1 (now in flight), DSpark 3, auto (plain probe).
#
# Only 8 files come back from a call, so the part ends by packing $OUT into one session15-PART.tgz.
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack, dispatch

part_a() {
  tests a_moe_tests 120 tests/kernels/test_moe.py tests/kernels/test_slot_noise.py -k "fp8 or decode or packed or stages or noise"
  tests a_engine_tests 150 tests/engine/test_engine_static_mtp.py tests/engine/test_engine_static_gpu.py \
    tests/engine/test_engine_draft_lookahead_plain.py tests/engine/test_engine_draft_lookahead_auto.py
  logged a_stages 150 python3 bench/moe_decode_tiles.py --layers v4-flash,v4-mini --kinds fp8,bf16 --tokens 1 --graph \
    --fp8-steps 512,1024,2048 --rows 4,8,16 --stages 1,2,3 --out "$OUT/moe-decode-tiles-stages-h200.json"
  tail -n 6 $W/logs/a_stages.txt | cut -c1-400
  logged a_packed 150 python3 bench/moe_packed_tiles.py --out "$OUT/moe-packed-tiles-h200.json"
  tail -n 12 $W/logs/a_packed.txt | cut -c1-400
}

part_b() {
  logged b_engine 400 python3 bench/engine_h200.py --static-decode --overlap --decode-only --steps 8 --confidence 0.8629 \
    --table-from-cells --modes none,mtp1,dspark3,auto_async --requests 1,64 --contexts 4096 --budget-s 380 \
    --out "$OUT/engine-h200-s15b.json"
  tail -n 24 $W/logs/b_engine.txt | cut -c1-300
}

dispatch session15 "${1:-}"
