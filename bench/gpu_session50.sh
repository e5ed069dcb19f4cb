#!/usr/bin/env bash
# GPU steps of the forty-sixth session (every JSON names its card):
#
#   run(command="bash bench/gpu_session50.sh a")   # ≈ 7 min, an H200 only (on an H100 it runs part b)
#
# a: issue 7's engine grid on its card (v4-mini, 4K, 1 and 64 requests: none, DSpark 1-3 and the async auto
#    planner, HF eager `generate` as the peer in the same call), last timed on an H200 in the thirty-sixth session;
#    every step change since then was timed on an H100 only. On an H100: part b.
# b: `gpu_session49.sh c`'s candidates (the GEMVs' 2048-wide K tiles, a CSA layer's indexer head weights before
#    it waits for c_q) in the v4-mini graph step at 1, 2 and 4 requests, one process, tagged s46.
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, step, tests, dispatch

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  if [ "$(card)" = h200 ]; then
    logged engine 420 python3 bench/engine_h200.py --static-decode --overlap --decode-only --peer --steps 8 \
      --confidence 0.8629 --table-from-cells --modes none,dspark1,dspark2,dspark3,auto_async --requests 1,64 \
      --contexts 4096 --budget-s 300 --out "$OUT/engine-h200-s46.json"
    tail -n 16 "$W/logs/engine.txt" | cut -c1-300
  else
    part_b
  fi
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  step "k-tile-ab-v4-$(card)-s46" 130 --requests 1,2,4 --gemv-ab k_tile_2048,head_weights_early
  grep -h "gemv_ab_speedup" "$W"/logs/k-tile-ab-*.txt | grep -o '"\(k_tile_2048\|head_weights_early\)": [0-9.]*'
}

dispatch session50 "${1:-}"
