#!/usr/bin/env bash
# GPU steps of the sixteenth session (each part < 9.5 min on one H200):
#
#   run(command="bash bench/gpu_session17.sh a", kind="nvidia-h200")
#   run(command="bash bench/gpu_session17.sh b", kind="nvidia-h200")
#   run(command="bash bench/gpu_session17.sh c", kind="nvidia-h200")
#   run(command="bash bench/gpu_session17.sh d", kind="nvidia-h200")
#   run(command="bash bench/gpu_session17.sh e", kind="nvidia-h200", timeout_s=250)
#
# a (ran at 44af5c8, which part a needs to run again): FP8 weights read by bit placement in the decode
#    MoE (`DecodeTiles.bits`, `moe_decode._e4m3_bits`):
#    its GPU tests, both kernels under Nsight Compute with and without it (one token, V4-Flash, FP8
#    128x128: pipe utilisation, stalls, DRAM throughput), the V4-Flash decode sweep with it at 1 and 8
#    tokens (FP8 128x128 and 32x32; `shipped` is the table's shape without it, timed in the same run);
#    then the engine at 1 / 64 requests with the auto planner planning the next round while the
#    device runs (`DraftLookahead.prepare`).
# b: the same engine comparison at the other loads (8, 32, 128, 256 requests and 1 again, 4K).
# Part a's bit placement lost (whole op 67.8 -> 71.4 us at one token, 321.5 -> 411.5 at 8) and was
# removed (its code: commit 44af5c8); its Nsight Compute rows showed both kernels far from every
# pipe's peak, the down kernel at 25 % occupancy (registers) and 38 % issue slots: latency, not math.
# c: the decode MoE's column sums deferred to the end of each row (`DecodeTiles.up_defer` /
#    `down_defer`, `moe_decode._gemv_acc`: no cross-thread reduction and barrier per K step): its GPU
#    tests, the V4-Flash FP8 sweep with it at 1 and 8 tokens (`shipped`: the table's shapes without it).
#    It won only for bf16 V4-Flash at one token (shipped there); the FP8 sweep ran out of its time at
#    32x32 blocks and 8 tokens.
# d: with that shape shipped: the decode MoE and auto-in-flight GPU tests, the fused MoE as one op
#    (router included, graph replays) at 1 and 8 tokens for bf16 and both FP8 kinds, and
#    `bench/wide_spills.py` (fixed last session, never run to the end).
# e: part b's comparison at 32K (1, 64, 256 requests), in the device time left.
source "$(dirname "$0")/gpu_lib.sh"  # logged, step, tests, pack, dispatch

ncu_bin() { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1; }

part_a() {
  tests a_bits_tests 150 tests/kernels/test_moe.py -k "e4m3_bits or bit_placed or decode_experts_any_tiles"
  local ncu; ncu=$(ncu_bin)
  for block in 128 32; do
    logged "a_ncu_$block" 150 "$ncu" --clock-control none --profile-from-start off --csv --page details \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats \
      --section Occupancy --section MemoryWorkloadAnalysis \
      --metrics "regex:sm__inst_executed_pipe_.*sum.pct_of_peak_sustained_active" \
      python3 bench/moe_decode_ncu.py --block "$block"
    grep -h "Duration\|DRAM Throughput\|Memory Throughput\|Issue Slots Busy\|No Eligible\|pipe_\|relative difference" \
      "$W/logs/a_ncu_$block.txt" | cut -c1-220 | head -n 60
  done
  logged a_bits_sweep 260 python3 bench/moe_decode_tiles.py --layers v4-flash --kinds fp8,fp8-32 --tokens 1,8 --graph \
    --rows 8,16,32 --fp8-steps 512,1024,2048 --bits 1 --out "$OUT/moe-decode-tiles-bits-h200.json"
  grep -h "shipped" $W/logs/a_bits_sweep.txt | cut -c1-900
  logged a_engine 200 python3 bench/engine_h200.py --static-decode --overlap --decode-only --steps 8 --confidence 0.8629 \
    --table-from-cells --modes none,dspark1,dspark2,dspark3,auto_async --requests 1,64 --contexts 4096 --budget-s 180 \
    --out "$OUT/engine-h200-s17a.json"
  tail -n 14 $W/logs/a_engine.txt | cut -c1-300
}

part_b() {
  logged b_engine 540 python3 bench/engine_h200.py --static-decode --overlap --decode-only --steps 8 --confidence 0.8629 \
    --table-from-cells --modes none,dspark1,dspark2,dspark3,auto_async --requests 1,8,32,128,256 --contexts 4096 \
    --budget-s 500 --out "$OUT/engine-h200-s17b.json"
  tail -n 14 $W/logs/b_engine.txt | cut -c1-300
}

part_c() {
  tests c_defer_tests 150 tests/kernels/test_moe.py -k "decode"
  logged c_defer_sweep 330 python3 bench/moe_decode_tiles.py --layers v4-flash --kinds fp8,fp8-32 --tokens 1,8 --graph \
    --rows 8,16,32 --fp8-steps 256,512,1024 --defer 1 --out "$OUT/moe-decode-tiles-defer-h200.json"
  grep -h "shipped" $W/logs/c_defer_sweep.txt | cut -c1-900
  logged c_defer_bf16 150 python3 bench/moe_decode_tiles.py --layers v4-flash,v4-mini --kinds bf16 --tokens 1 --graph \
    --rows 4,8 --defer 0,1 --out "$OUT/moe-decode-tiles-defer-bf16-h200.json"
  grep -h "shipped" $W/logs/c_defer_bf16.txt | cut -c1-900
}

part_d() {
  tests d_tests 150 tests/kernels/test_moe.py tests/engine/test_engine_draft_lookahead_auto.py -k "decode or cuda_graphs"
  logged d_kernels 150 python3 bench/kernels.py --graph --configs flash --ops fused_moe,fused_moe_fp8_128,fused_moe_fp8_32 \
    --tokens 1,8 --model-steps 0 --out "$OUT/kernels-moe-graph-s17-h200.json"
  tail -n 8 $W/logs/d_kernels.txt | cut -c1-200
  logged d_spills 140 python3 bench/wide_spills.py --out "$OUT/wide-spills-h200.json"
  tail -n 12 $W/logs/d_spills.txt | cut -c1-300
}

part_e() {
  logged e_engine_32k 220 python3 bench/engine_h200.py --static-decode --overlap --decode-only --steps 8 --confidence 0.8629 \
    --table-from-cells --modes none,dspark1,dspark2,dspark3,auto_async --requests 1,64,256 --contexts 32768 \
    --budget-s 190 --out "$OUT/engine-h200-s17e-32k.json"
  tail -n 30 $W/logs/e_engine_32k.txt | cut -c1-300
}

dispatch session17 "${1:-}"
