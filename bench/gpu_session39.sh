#!/usr/bin/env bash
# GPU steps of the thirty-seventh session, for one H200 (an H100 runs them too; every JSON names its card).
# Part a ran in that session on an H100 (bench/README.md); the select variants it times were then taken out:
# run it at commit c5312a7.
#
#   run(command="bash bench/gpu_session39.sh a")   # ≈ 3 min
#
# a: the decode router's select kernel variants (`RouteTiles.select_warps`, `gather_once`): the router's GPU
#    tests, then `bench/route_select.py` (the router alone and the whole MoE op at each variant).
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, pack, dispatch

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests a_tests 90 --tb=line tests/kernels/test_kernels_route_decode.py
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  logged a_select 300 python3 bench/route_select.py --out "$OUT/route-select-$(card)-s37.json"
  grep -h "router" "$W/logs/a_select.txt" | cut -c1-200
}

dispatch session39 "${1:-}"
