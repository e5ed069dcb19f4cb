#!/usr/bin/env bash
# The GPU steps written in the fourth 2026-11-30 session and not yet run (each part < 9.5 min):
#
#   run(command="bash bench/gpu_session5.sh profile; bash bench/gpu_session5.sh graphs", kind="nvidia-h200")
#   run(command="bash bench/gpu_session5.sh v41; bash bench/gpu_session5.sh engine")
#   run(command="bash bench/gpu_session5.sh host")
#   run(command="bash bench/gpu_session5.sh final")
#   run(command="bash bench/gpu_session5.sh overlap")   # next session: overlap on/off, select_topk, the stage test
#   run(command="bash bench/gpu_session5.sh buckets")
#   run(command="bash bench/gpu_session5.sh kernels")
#   run(command="bash bench/gpu_session5.sh engram", kind="nvidia-h200-x2")
#
# profile: where the v4-mini graph-replayed decode step spends its time at 1 and 8 requests, 4K context
#    (bench/graph_decode.py --profile: kernel time per name, launches per step, busy fraction).
# graphs: the GPU tests of the static (graph-captured) paths — the engine's static_decode against the
#    default engine, the static DSpark drafter (replay == eager == dynamic greedy, no host sync), the
#    V4.1 static step — then the drafter's propose / observe timings (bench/graph_draft.py) and the
#    v41-mini graph decode step (bench/graph_decode.py --config v41-mini).
# engine: bench/engine_h200.py --static-decode (v4-mini, every decode cell on static slots and CUDA
#    graphs), to set beside engine-h200-s4.json (the dynamic path).
# buckets: bench/slot_buckets_h200.py — step time against live requests on one 64-slot static engine
#    (compaction + power-of-two buckets), plain and DSpark budget 3.
# kernels: the one-launch decode attention also as a CUDA-graph replay (bench/attn_batched.py
#    `graph_us`), the decode MoE with the shipped per-size launch shapes (bench/moe_decode_tiles.py
#    `shipped`).
# engram (2 GPUs): bench/engram_shard_nccl.py with the cache_qat=False comparison against one process.
set -uo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=/tmp/gpu-session && mkdir -p $W/logs

logged() {  # logged NAME TIMEOUT CMD...: run CMD under a timeout into $W/logs/NAME.txt, record rc
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$W/logs/$name.txt" 2>&1
  echo "$name rc=$?" | tee -a "$W/logs/$name.txt"
}

part_profile() {
  logged graph_profile 200 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200.json"
  grep -h "^{" $W/logs/graph_profile.txt | cut -c1-1500
}

part_host() {  # after StepIndex, batched greedy verification and the static default: tests, launch sites, engine rows
  logged host_tests 200 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_engine_static_gpu.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  logged host_profile 150 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200-index.json"
  logged host_engine 200 python3 bench/engine_h200.py --static-decode --requests 1,8,64 --modes none,dspark3 \
    --contexts 4096 --decode-only --steps 8 --budget-s 150 --out "$OUT/engine-h200-static-host.json"
  tail -n 3 $W/logs/host_tests.txt; grep -h "^{" $W/logs/host_profile.txt | cut -c1-2500
  grep -h '"mode"' $W/logs/host_engine.txt | cut -c1-260
}

part_final() {  # after the fused norm / RoPE ops, the decode router and the shared step indices (one call, < 9.5 min)
  logged final_profile 130 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200-final.json"
  logged final_engine 130 python3 bench/engine_h200.py --static-decode --requests 1,8,64 --modes none,dspark3 \
    --contexts 4096 --decode-only --steps 8 --budget-s 95 --out "$OUT/engine-h200-static-final.json"
  logged final_route 100 python3 bench/route_decode.py --out "$OUT/route-decode-h200.json"
  logged final_tests 190 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_kernels_norm_rope.py \
    tests/kernels/test_kernels_route_decode.py tests/kernels/test_cuda_graphs.py \
    "tests/kernels/test_kernels_model.py::test_fused_matches_reference_on_gpu" tests/kernels/test_draft_stage_kernels.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py \
    tests/engine/test_engine_static_gpu.py
  grep -h "^{" $W/logs/final_profile.txt | cut -c1-1200
  grep -h '"mode"' $W/logs/final_engine.txt | cut -c1-200
  tail -n 4 $W/logs/final_route.txt | cut -c1-600
  tail -n 12 $W/logs/final_tests.txt | cut -c1-300
}

part_overlap() {  # written after the device time ran out: the engine with one greedy step in flight
  logged overlap_tests 150 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_engine_static_gpu.py \
    tests/kernels/test_lightning_indexer.py "tests/kernels/test_draft_stage_kernels.py"
  logged overlap_off 150 python3 bench/engine_h200.py --static-decode --requests 1,8,64 --modes none \
    --contexts 4096 --decode-only --steps 16 --budget-s 110 --out "$OUT/engine-h200-overlap-off.json"
  logged overlap_on 150 python3 bench/engine_h200.py --static-decode --overlap --requests 1,8,64 --modes none \
    --contexts 4096 --decode-only --steps 16 --budget-s 110 --out "$OUT/engine-h200-overlap-on.json"
  logged overlap_profile 130 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200-topk.json"
  tail -n 6 $W/logs/overlap_tests.txt; grep -h '"mode"' $W/logs/overlap_off.txt $W/logs/overlap_on.txt | cut -c1-200
  grep -h "^{" $W/logs/overlap_profile.txt | cut -c1-600
}

part_graphs() {
  logged graph_tests 240 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_engine_static_gpu.py \
    tests/draft/test_static_draft_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py
  logged graph_draft 120 python3 bench/graph_draft.py --out "$OUT/graph-draft-h200.json"
  logged graph_v41 180 python3 bench/graph_decode.py --config v41-mini --out "$OUT/graph-decode-v41-mini-h200.json"
  tail -n 8 $W/logs/graph_tests.txt; grep -h "^{" $W/logs/graph_draft.txt $W/logs/graph_v41.txt | cut -c1-400
}

part_v41() {  # the V4.1 graph step after the e2m1 fix (capture with cache QAT on)
  logged v41_tests 150 python3 -m pytest -q -p no:cacheprovider -rs tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  logged graph_v41 150 python3 bench/graph_decode.py --config v41-mini --requests 1,8 --profile --out "$OUT/graph-decode-v41-mini-h200.json"
  tail -n 3 $W/logs/v41_tests.txt; grep -h "^{" $W/logs/graph_v41.txt | cut -c1-700
}

part_engine() {
  logged engine_static 470 python3 bench/engine_h200.py --static-decode --steps 8 --budget-s 370 --out "$OUT/engine-h200-static.json"
  tail -n 30 $W/logs/engine_static.txt | cut -c1-300
}

part_buckets() {
  logged buckets 400 python3 bench/slot_buckets_h200.py --out "$OUT/slot-buckets-h200.json"
  tail -n 20 $W/logs/buckets.txt | cut -c1-300
}

part_kernels() {
  logged attn_batched 300 python3 bench/attn_batched.py --skip-model --out "$OUT/attn-batched-graph-h200.json"
  logged tiles 200 python3 bench/moe_decode_tiles.py --out "$OUT/moe-decode-tiles-shipped-h200.json"
  grep -h "graph\|shipped" $W/logs/attn_batched.txt $W/logs/tiles.txt | cut -c1-300
}

part_engram() {
  logged engram_nccl 240 torchrun --nproc-per-node 2 bench/engram_shard_nccl.py  # -> $OUT/engram_shard_nccl.json
  tail -n 5 $W/logs/engram_nccl.txt
}

part_$1
tar -C $W -cf "$OUT/logs-$1.tar" logs
ls -la "$OUT"
