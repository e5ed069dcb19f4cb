#!/usr/bin/env bash
# GPU steps of the forty-second session (one H100 or H200; every JSON names its card):
#
#   run(command="bash bench/gpu_session46.sh a")   # ≈ 6 min (≈ 8 on an H200)
#   run(command="bash bench/gpu_session46.sh b")   # ≈ 4 min
#   run(command="bash bench/gpu_session46.sh d", carry=[".whl"])   # ≈ 8 min: on an H200 a's MoE rows and c,
#                                               # elsewhere c alone
#   run(command="bash bench/gpu_session46.sh e", carry=[".whl"])   # ≈ 6 min on an H200, else nothing
#   run(command="bash bench/gpu_session46.sh f", carry=[".ab"])    # ≈ 3 min; .ab/moe_decode_tma_old.py is
#                                               # `git show <commit before the 1-D EARLY grid>:dspark/kernels/moe_decode_tma.py`
#   run(command="bash bench/gpu_session46.sh g", carry=[".ab"])    # ≈ 3 min (≈ 5 on an H200)
#   run(command="bash bench/gpu_session46.sh h", carry=[".whl"])   # ≈ 4 min on an H200, else nothing
#   run(command="bash bench/gpu_session46.sh c", carry=[".whl"])   # ≈ 5 min (the drafter's weights moved out
#                                               # of the tree for the call: the carry limit)
#
# a: why the one-token FP8 gate/up launch streams at about 74 % of the copy bandwidth when the same kernel
#    reaches about 97 % at 8 tokens. First the L2 flush of every timing (`bench/l2_flush.py`: issue 6's MoE
#    ops and a plain read of as many bytes, each after `graph_timer`'s 256 MB write flush and after a 256 MB
#    read, in turn: the write leaves dirty lines that the op then writes back). On an H200 issue 6's MoE rows
#    after either flush (`bench/kernels.py --graph --flush write|read`). Then Nsight Compute on the decode
#    experts (V4-Flash FP8 128×128, shipped shapes, late and EARLY grids) at 1 and 8 tokens
#    (`bench/moe_decode_ncu.py`: occupancy, waves, warp stalls, DRAM throughput), and the TMA gate/up kernel
#    alone at 1, 2, 4 and 8 tokens at the shipped shape on the EARLY grid (the rate against the number of
#    programs).
# b: the TMA gate/up kernel at one token over smaller and wider programs on the EARLY grid
#    (`bench/moe_decode_tma.py --tiles ... --sweep-early`); then issue 6's whole op with each kind's best of
#    those shapes against the op as shipped, in turn (`--up-ab-from`).
# d: on an H200 issue 6's MoE rows after either flush, then c; on an H100 c alone.
# e: part d on an H200 only (an H100 ran c in the forty-second session and `bench/l2_flush.py` has the MoE ops).
# f: the EARLY gate/up grid in the usual grid's order (row block by row block, the shared rows' programs
#    first) against the transposed one it replaced (.ab): issue 6's whole op as shipped against the op with the
#    promise withheld (`bench/moe_decode_tma.py --early --early-max-tokens 8`, V4-Flash FP8 128×128, 1 and 8
#    tokens) with either file in place, one after the other; then the TMA kernels' early and GPU tests.
# g: on an H200 first issue 6's MoE rows after the read flush; then f.
# h: on an H200 only, issue 6's MoE rows after the read flush, then c (e without the write-flushed MoE rows).
# c: issue 6's decode attention at 32K on flashinfer (`bench/attn_batched.py --batches 256,512`; the graph with
#    the sink pass and the kernel alone, each after the write flush and after the read flush).
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, pack, dispatch, attention_32k, swap, moe_rows_h200, ncu_experts

moe_rows_both_flushes() {  # on an H200 only: issue 6's V4-Flash MoE rows after either flush
  for flush in write read; do moe_rows_h200 s42 "$flush"; done
}

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged "l2-flush-$(card)-s42" 200 python3 bench/l2_flush.py --out "$OUT/l2-flush-$(card)-s42.json"
  grep -h "flush" "$W/logs/l2-flush-$(card)-s42.txt" | cut -c1-220
  tail -n 2 "$W/logs/l2-flush-$(card)-s42.txt" | cut -c1-300
  moe_rows_both_flushes
  ncu_experts "moe-decode-ncu-fp8-128-m1-$(card)-s42" --block 128 --tokens 1
  [ "$(card)" = h200 ] || ncu_experts "moe-decode-ncu-fp8-128-m8-$(card)-s42" --block 128 --tokens 8
  logged "tma-scale-$(card)-s42" 100 python3 bench/moe_decode_tma.py --layers v4-flash --kinds fp8 \
    --tokens 1,2,4,8 --tiles 16x256x4 --stages 5 --sweep-early --out "$OUT/moe-tma-scale-$(card)-s42.json"
  grep -h "up gemv" "$W/logs/tma-scale-$(card)-s42.txt" | cut -c1-200
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged "tma-tiles-$(card)-s42" 240 python3 bench/moe_decode_tma.py --layers v4-flash --kinds fp8,fp8-32 --tokens 1 \
    --tiles 4x512x4,4x1024x4,8x256x4,8x512x4,8x1024x4,16x256x4,16x512x4,32x256x4 --stages 3,5 --sweep-early \
    --out "$OUT/moe-tma-tiles-$(card)-s42.json"
  grep -h "up gemv" "$W/logs/tma-tiles-$(card)-s42.txt" | cut -c1-200
  tail -n 2 "$W/logs/tma-tiles-$(card)-s42.txt" | cut -c1-300
  logged "tma-tiles-ab-$(card)-s42" 120 python3 bench/moe_decode_tma.py --up-ab-from "$OUT/moe-tma-tiles-$(card)-s42.json" \
    --out "$OUT/moe-tma-tiles-ab-$(card)-s42.json"
  grep -h "op " "$W/logs/tma-tiles-ab-$(card)-s42.txt" | cut -c1-200
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  attention_32k s42
}

part_d() {
  moe_rows_both_flushes
  part_c
}

part_e() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  [ "$(card)" = h200 ] || { echo "not an H200: nothing to run"; return 0; }
  part_d
}

part_f() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  for side in old new; do
    swap "$side" dspark/kernels/moe_decode_tma.py
    logged "early-$side-$(card)-s42" 100 python3 bench/moe_decode_tma.py --early --layers v4-flash --kinds fp8 \
      --tokens 1,8 --early-max-tokens 8 --out "$OUT/moe-early-$side-$(card)-s42.json"
    grep -h "early" "$W/logs/early-$side-$(card)-s42.txt" | cut -c1-300
  done
  tests f_tma 90 tests/kernels/test_moe_decode_tma.py -k "early or gpu"
}

part_g() {
  moe_rows_h200 s42 read
  part_f
}

part_h() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  [ "$(card)" = h200 ] || { echo "not an H200: nothing to run"; return 0; }
  moe_rows_h200 s42 read
  part_c
}

dispatch session46 "${1:-}"
