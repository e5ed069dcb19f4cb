#!/usr/bin/env bash
# GPU steps of the thirty-fifth session, for one H200 (an H100 runs them too; every JSON names its card):
#
#   run(command="bash bench/gpu_session37.sh a")   # ≈ 9 min
#   run(command="bash bench/gpu_session37.sh b")   # ≈ 5 min
#   run(command="bash bench/gpu_session37.sh c")                  # ≈ 7 min
#
# a: the decode MoE's shared expert on a side stream (`moe_decode.SharedAside`, CPU-tested under the
#    interpreter): its GPU tests with the rest of the MoE and W8A8 tests (the W8A8 weights now made on
#    the device), then `bench/kernels.py`'s MoE rows with and without it (`*_aside`): V4-Flash and
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
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, step, pack, dispatch

aside_rounds() {  # aside_rounds PART ROUNDS: the v4-mini graph step with moe_shared on ("on") and off, in turn
  local round
  for round in $(seq "$2"); do
    step "$1_v4_on_$round" 80 --requests 1,8 --triton moe_shared
    step "$1_v4_off_$round" 80 --requests 1,8
  done
}

card() { nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[12]00' | tr 'H' 'h'; }

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests a_tests 150 --tb=line tests/kernels/test_moe.py tests/kernels/test_cuda_graphs.py \
    tests/kernels/test_moe_w8a8.py -k "not test_moe_w8a8.py or early or model"
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null  # back even if the call runs out of time before `pack`
  logged a_moe 230 python3 bench/kernels.py --configs flash,mini --tokens 1,8,64 --model-steps 0 --graph \
    --ops fused_moe,fused_moe_aside,fused_moe_fp8_128,fused_moe_fp8_128_aside,fused_moe_fp8_32,fused_moe_fp8_32_aside \
    --out "$OUT/kernels-moe-aside-$(card)-s35.json"
  grep -h "fused_moe" "$W/logs/a_moe.txt" | cut -c1-200
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  aside_rounds a 1
}

part_q() {  # part a in less time: the aside tests, its kernels rows at 1 and 8 tokens, one step round
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests q_tests 100 --tb=line tests/kernels/test_moe.py tests/kernels/test_cuda_graphs.py \
    -k "aside or join or decode or fused_moe_replays"
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  logged q_moe 170 python3 bench/kernels.py --configs flash,mini --tokens 1,8 --model-steps 0 --graph \
    --ops fused_moe,fused_moe_aside,fused_moe_fp8_128,fused_moe_fp8_128_aside,fused_moe_fp8_32,fused_moe_fp8_32_aside \
    --out "$OUT/kernels-moe-aside-$(card)-s35.json"
  grep -h "fused_moe" "$W/logs/q_moe.txt" | cut -c1-200
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  aside_rounds q 1
}

part_r() {  # the least: the aside's GPU tests, bf16 and FP8-128 rows at 1 and 8 tokens, one step pair
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests r_tests 60 --tb=line tests/kernels/test_moe.py tests/kernels/test_cuda_graphs.py \
    -k "aside or join or shared or fused_moe_replays"
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  logged r_moe 110 python3 bench/kernels.py --configs flash,mini --tokens 1,8 --model-steps 0 --graph \
    --ops fused_moe,fused_moe_aside,fused_moe_fp8_128,fused_moe_fp8_128_aside \
    --out "$OUT/kernels-moe-aside-$(card)-s35.json"
  grep -h "fused_moe" "$W/logs/r_moe.txt" | cut -c1-200
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  step r_v4_on_1 70 --requests 1,8 --triton moe_shared
  step r_v4_off_1 70 --requests 1,8
}

part_s() {  # a couple of minutes: the aside's GPU tests and V4-Flash FP8-128 at one token with and without it
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests s_tests 70 --tb=line tests/kernels/test_moe.py tests/kernels/test_cuda_graphs.py -k "aside or join or shared"
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null
  logged s_moe 80 python3 bench/kernels.py --configs flash --tokens 1 --model-steps 0 --graph \
    --ops fused_moe_fp8_128,fused_moe_fp8_128_aside --out "$OUT/kernels-moe-aside-$(card)-s35.json"
  grep -h "fused_moe" "$W/logs/s_moe.txt" | cut -c1-200
}

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
