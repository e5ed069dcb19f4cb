#!/usr/bin/env bash
# GPU steps of the fifteenth session (each part < 9.5 min on one H200):
#
#   run(command="bash bench/gpu_session16.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session16.sh b", kind="nvidia-h200")
#   run(command="bash bench/gpu_session16.sh c", kind="nvidia-h200")
#   run(command="bash bench/gpu_session16.sh d", kind="nvidia-h200")
#   run(command="bash bench/gpu_session16.sh e", kind="nvidia-h200")
#   run(command="bash bench/gpu_session16.sh f", kind="nvidia-h200")
#
# (`bench/gpu_session15.sh a` ran first this session: its packed-tile sweep picked the new decode
# tiles of `moe._tiles`; its stages sweep hit a shape past the shared memory, now recorded and skipped;
# its engine tests ran out of their 150 s.)
# a: the MoE on the new packed decode tiles (128-wide K steps; FP8 steps over several 32-wide scale
#    blocks): its GPU tests, the whole op as CUDA-graph replays (`bench/kernels.py --graph`: the issue's
#    % of HBM for FP8 128x128 / 32x32 and bf16 at M = 1, 8, 16, 64), the packed sweep again for 32x32
#    blocks (now uncapped K steps), and the decode MoE's pipelined loops at one token.
# b: the engine's GPU tests (rounds in flight, plain probe, static MTP in flight, sampled static rounds
#    with the `slot_noise` kernel now on by default), then the engine at 1 / 64 requests, 4K.
# c: the decode MoE's down launch split per expert term (`DecodeTiles.split_down`): its GPU tests, and
#    the one-token sweep with the whole op at the shipped shapes split and unsplit (A/B in one run).
#    Ran at 9107bc5; the split lost (moe-decode-tiles-split-h200.json) and was reverted, so part c
#    needs that commit to run again.
# d: the decode MoE's launch shapes for V4.1's 32x32 FP8 blocks (they ran the 128x128 tables' shapes):
#    the sweep at 1 and 8 tokens, both layers, with the whole op at each kernel's best shape.
# e: with part d's shapes shipped (`moe_decode._MEASURED_FP8_32`): the fused MoE as one op at 1 and 8
#    tokens (router included, graph replays) for FP8 32x32 and 128x128; the v4-mini one-request graph
#    step and its kernel profile with PDL off (the per-kernel breakdown after the eleventh session's).
# f: `bench/wide_spills.py` (written in the fifth session, never run): the registers / spills the JIT
#    built for `attention_wide`'s launches next to the compile test's ahead-of-time build of the same.
#
# Only 8 files come back from a call, so the part ends by packing $OUT into one session16-PART.tgz.
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack, dispatch

part_a() {
  tests a_moe_tests 120 tests/kernels/test_moe.py tests/kernels/test_slot_noise.py -k "packed or fused_moe or paths or k_step or noise"
  logged a_kernels 200 python3 bench/kernels.py --graph --configs flash --ops fused_moe_fp8_128,fused_moe_fp8_32,fused_moe \
    --tokens 1,8,16,64 --model-steps 0 --out "$OUT/kernels-moe-graph-h200.json"
  tail -n 16 $W/logs/a_kernels.txt | cut -c1-200
  logged a_packed 130 python3 bench/moe_packed_tiles.py --kinds fp8-32,fp8-128 --tokens 16,64 --out "$OUT/moe-packed-tiles-s16-h200.json"
  tail -n 5 $W/logs/a_packed.txt | cut -c1-400
  logged a_stages 100 python3 bench/moe_decode_tiles.py --layers v4-flash --kinds fp8 --tokens 1 --graph \
    --fp8-steps 1024,2048 --rows 8,16 --stages 1,2,3 --out "$OUT/moe-decode-tiles-stages-h200.json"
  tail -n 3 $W/logs/a_stages.txt | cut -c1-600
}

part_b() {
  [ "${SKIP_TESTS:-}" ] || tests b_engine_tests 300 -m gpu tests/engine/test_engine_static_mtp.py tests/engine/test_engine_static_gpu.py \
    tests/engine/test_engine_draft_lookahead_plain.py tests/engine/test_engine_draft_lookahead_auto.py \
    tests/engine/test_engine_draft_lookahead.py
  logged b_engine 470 python3 bench/engine_h200.py --static-decode --overlap --decode-only --peer --steps 8 --confidence 0.8629 \
    --table-from-cells --modes none,mtp1,dspark1,dspark2,dspark3,auto_async --requests 1,64 --contexts 4096 --budget-s 400 \
    --out "$OUT/engine-h200-s16b.json"
  tail -n 24 $W/logs/b_engine.txt | cut -c1-300
}

part_c() {
  tests c_moe_tests 120 tests/kernels/test_moe.py -k "decode"
  logged c_split 330 python3 bench/moe_decode_tiles.py --layers v4-flash,v4-mini --kinds fp8,bf16 --tokens 1 --graph \
    --rows 4,8,16 --fp8-steps 512,1024,2048 --split-down --out "$OUT/moe-decode-tiles-split-h200.json"
  grep -h "shipped" $W/logs/c_split.txt | cut -c1-900
}

part_d() {
  tests d_moe_tests 100 tests/kernels/test_moe.py -k "decode"
  logged d_fp8_32_one 150 python3 bench/moe_decode_tiles.py --layers v4-flash,v4-mini --kinds fp8-32 --tokens 1 --graph \
    --rows 4,8,16 --fp8-steps 256,512,1024 --out "$OUT/moe-decode-tiles-fp8-32-m1-h200.json"
  logged d_fp8_32_eight 150 python3 bench/moe_decode_tiles.py --layers v4-flash,v4-mini --kinds fp8-32 --tokens 8 --graph \
    --rows 16,32 --fp8-steps 256,512,1024 --out "$OUT/moe-decode-tiles-fp8-32-m8-h200.json"
  grep -h "shipped" $W/logs/d_fp8_32_*.txt | cut -c1-1200
}

part_e() {
  logged e_kernels 120 python3 bench/kernels.py --graph --configs flash --ops fused_moe_fp8_32,fused_moe_fp8_128 \
    --tokens 1,8 --model-steps 0 --out "$OUT/kernels-moe-graph-e-h200.json"
  tail -n 6 $W/logs/e_kernels.txt | cut -c1-200
  step graph-decode-h200-s16 100 --requests 1
  step graph-profile-h200-s16-no-pdl 100 --requests 1 --no-pdl --profile
}

part_f() {
  logged f_spills 140 python3 bench/wide_spills.py --out "$OUT/wide-spills-h200.json"
  tail -n 12 $W/logs/f_spills.txt | cut -c1-300
}

dispatch session16 "${1:-}"
