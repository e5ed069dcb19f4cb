#!/usr/bin/env bash
# GPU steps of the thirty-fifth session, for one H200 (an H100 runs them too; every JSON names its card):
#
#   run(command="bash bench/gpu_session37.sh a")   # ≈ 9 min
#   run(command="bash bench/gpu_session37.sh b")   # ≈ 5 min
#   run(command="bash bench/gpu_session37.sh c")   # ≈ 7 min
#
# a: the decode MoE's shared expert on a side stream (`moe_decode.SharedAside`, CPU-tested under the
#    interpreter): the W8A8 side-stream tests (its `InputQuant` now runs on `aside.Aside`), the MoE and
#    graph-replay GPU tests, then `bench/kernels.py`'s MoE rows with and without it (`*_aside`): V4-Flash and
#    v4-mini layers with the router, bf16 / FP8 128×128 / FP8 32×32, 1, 8 and 64 tokens, CUDA-graph
#    replays; then the v4-mini graph step with `KernelConfig(moe_shared="triton")` (the shared expert
#    aside in every MoE layer; `registry.NOT_YET_ON_GPU` until this has run) and without, separate
#    processes in turn, one round at 1 and 8 requests.
# q: part a in under 8 minutes (its tests filtered, 1 and 8 tokens) for a short device budget.
# r: less again (about 5 minutes): the aside's tests, bf16 and FP8-128 rows at 1 and 8 tokens, one step pair.
# s: the least of all (about 3 minutes): the aside's GPU tests, V4-Flash FP8-128 at one token with and without.
# b: two more rounds of that step A/B.
# c: issue 7's engine table with the HF eager peer in the same call (`gpu_session24.sh a`'s engine step,
#    without MTP): batch-1 % of the HBM roofline, × HF, DSpark 3 / none and auto at 1 and 64 requests.
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, step, pack, dispatch

aside_rounds() {  # aside_rounds PART ROUNDS: the v4-mini graph step with moe_shared on ("on") and off, in turn
  local round
  for round in $(seq "$2"); do
    step "$1_v4_on_$round" 80 --requests 1,8 --triton moe_shared
    step "$1_v4_off_$round" 80 --requests 1,8
  done
}

aside_call() {  # aside_call PART TEST_LIMIT TEST_FILTER BENCH_LIMIT CONFIGS TOKENS OPS ROUNDS: the GPU tests
  # (pytest -k TEST_FILTER, empty for all), `bench/kernels.py`'s MoE rows, ROUNDS step pairs
  local part=$1 filter=$3 ops=$7
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests "${part}_tests" "$2" --tb=line tests/kernels/test_moe.py tests/kernels/test_cuda_graphs.py \
    ${filter:+-k "$filter"}
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null  # back even if the call runs out of time before `pack`
  logged "${part}_moe" "$4" python3 bench/kernels.py --configs "$5" --tokens "$6" --model-steps 0 --graph \
    --ops "$ops" --out "$OUT/kernels-moe-aside-$(card)-s35.json"
  grep -h "fused_moe" "$W/logs/${part}_moe.txt" | cut -c1-200
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  aside_rounds "$part" "$8"
}

ALL_MOE=fused_moe,fused_moe_aside,fused_moe_fp8_128,fused_moe_fp8_128_aside,fused_moe_fp8_32,fused_moe_fp8_32_aside
part_a() {
  tests a_w8a8 60 --tb=line tests/kernels/test_moe_w8a8.py -k "early or model"  # InputQuant on `aside.Aside`
  aside_call a 150 "" 230 flash,mini 1,8,64 "$ALL_MOE" 1
}
part_q() { aside_call q 100 "aside or join or decode or fused_moe_replays" 170 flash,mini 1,8 "$ALL_MOE" 1; }
part_r() {
  aside_call r 60 "aside or join or shared or fused_moe_replays" 110 flash,mini 1,8 \
    fused_moe,fused_moe_aside,fused_moe_fp8_128,fused_moe_fp8_128_aside 1
}
part_s() { aside_call s 70 "aside or join or shared" 80 flash 1 fused_moe_fp8_128,fused_moe_fp8_128_aside 0; }

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  aside_rounds b 2
}

part_c() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  logged c_engine 420 python3 bench/engine_h200.py --static-decode --overlap --decode-only --peer --steps 8 \
    --confidence 0.8629 --table-from-cells --modes none,dspark1,dspark2,dspark3,auto_async --requests 1,64 \
    --contexts 4096 --budget-s 300 --out "$OUT/engine-$(card)-s35.json"
  tail -n 16 "$W/logs/c_engine.txt" | cut -c1-300
}

dispatch session37 "${1:-}"
