#!/usr/bin/env bash
# GPU steps of the sixth 2026-11-30 session (each part < 9.5 min; flashinfer travels as wheels in .whl/):
#
#   run(command="bash bench/gpu_session6.sh fi", carry=[".whl"], kind="nvidia-h200")
#   run(command="bash bench/gpu_session6.sh check", carry=[".whl"])
#   run(command="bash bench/gpu_session6.sh overlap")
#   run(command="bash bench/gpu_session6.sh step")
#   run(command="bash bench/gpu_session6.sh final1", carry=[".whl"])
#   run(command="bash bench/gpu_session6.sh final2")
#   run(command="bash bench/gpu_session6.sh last")
#   run(command="bash bench/gpu_session6.sh next")    # written after the device time ran out: not run yet
#
# fi: flashinfer's MLA kernels behind `sparse_attention` (dspark/kernels/attention_flashinfer.py):
#    their GPU tests against the reference (the first call JIT-compiles them with nvcc), then the
#    32K decode-attention cases of bench/attn_batched.py on Triton (now also as CUDA-graph replays,
#    `graph_us`) and on flashinfer; and bench/draft_stage_diag.py, the call-by-call comparison of the
#    Triton and reference DSpark stages behind the known GPU failure of test_draft_stage_kernels.py.
set -uo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=/tmp/gpu-session && mkdir -p $W/logs

logged() {  # logged NAME TIMEOUT CMD...: run CMD under a timeout into $W/logs/NAME.txt, record rc
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$W/logs/$name.txt" 2>&1
  echo "$name rc=$?" | tee -a "$W/logs/$name.txt"
}

with_flashinfer() {  # the carried wheels on PYTHONPATH, nvcc for flashinfer's JIT
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:. FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
  local nvcc; nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
  [ -n "$nvcc" ] && export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")} PATH=$(dirname "$nvcc"):$PATH
  echo "nvcc: ${nvcc:-none}; CUDA_HOME=${CUDA_HOME:-unset}"; python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
}

part_fi() {
  with_flashinfer
  logged fi_tests 270 python3 -m pytest -q -p no:cacheprovider -rs -x tests/kernels/test_attention_flashinfer.py
  logged diag 90 python3 bench/draft_stage_diag.py --out "$OUT/draft-stage-diag-h200.json"
  logged attn 200 python3 bench/attn_batched.py --skip-model --skip-sweep --skip-per-request \
    --out "$OUT/attn-batched-graph-h200.json"
  tail -n 15 $W/logs/fi_tests.txt | cut -c1-400; head -c 1500 $W/logs/diag.txt
  grep -h "graph\|flashinfer" $W/logs/attn.txt | cut -c1-260
}

part_check() {  # after the first call: the stage test in fp32, the fused sink epilogue, 256 requests
  with_flashinfer
  logged check_tests 300 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_attention_flashinfer.py \
    tests/kernels/test_draft_stage_kernels.py tests/kernels/test_lightning_indexer.py tests/engine/test_engine_static_gpu.py
  logged diag32 90 python3 bench/draft_stage_diag.py --out "$OUT/draft-stage-diag-h200-fp32.json"
  logged attn256 150 python3 bench/attn_batched.py --skip-model --skip-sweep --skip-per-request --batches 64,128,256 \
    --out "$OUT/attn-batched-flashinfer-h200.json"
  tail -n 15 $W/logs/check_tests.txt | cut -c1-400; head -c 700 $W/logs/diag32.txt
  grep -h "graph\|flashinfer\|HBM" $W/logs/attn256.txt | cut -c1-260
}

part_overlap() {  # EngineConfig(overlap=True) on and off, and the step profile with select_topk (from gpu_session5.sh)
  export PYTHONPATH=.
  logged overlap_off 150 python3 bench/engine_h200.py --static-decode --requests 1,8,64 --modes none \
    --contexts 4096 --decode-only --steps 16 --budget-s 110 --out "$OUT/engine-h200-overlap-off.json"
  logged overlap_on 150 python3 bench/engine_h200.py --static-decode --overlap --requests 1,8,64 --modes none \
    --contexts 4096 --decode-only --steps 16 --budget-s 110 --out "$OUT/engine-h200-overlap-on.json"
  logged overlap_profile 130 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200-topk.json"
  grep -h '"mode"' $W/logs/overlap_off.txt $W/logs/overlap_on.txt | cut -c1-200
  grep -h "^{" $W/logs/overlap_profile.txt | cut -c1-600
}

part_step() {  # the split compressor pool and the head-split wo_a at decode sizes; launch-shape sweep
  export PYTHONPATH=.
  logged step_tests 240 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_compressor_pool.py \
    tests/kernels/test_grouped_wo_a.py "tests/kernels/test_kernels_model.py::test_fused_matches_reference_on_gpu" \
    tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  logged sweep 120 python3 bench/decode_sweep.py --out "$OUT/decode-sweep-h200.json"
  logged step_profile 130 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200-split.json"
  tail -n 6 $W/logs/step_tests.txt | cut -c1-300; grep -h "best" $W/logs/sweep.txt | cut -c1-200
  grep -h "^{" $W/logs/step_profile.txt | cut -c1-900
}

part_final1() {  # after the sweep's launch shapes: the step, the engine (overlap on, its default) with the HF peer
  with_flashinfer
  logged final_profile 120 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200-s6.json"
  logged final_engine 240 python3 bench/engine_h200.py --static-decode --overlap --requests 1,8,64 --modes none,dspark3 \
    --contexts 4096 --decode-only --peer --steps 8 --budget-s 170 --out "$OUT/engine-h200-s6.json"
  logged final_attn 90 python3 bench/attn_batched.py --skip-model --skip-sweep --skip-per-request --batches 512 \
    --out "$OUT/attn-batched-flashinfer-512-h200.json"
  grep -h "^{" $W/logs/final_profile.txt | cut -c1-700
  grep -h '"mode"\|ratio\|batch1' $W/logs/final_engine.txt | cut -c1-220
  grep -h "flashinfer\|graph" $W/logs/final_attn.txt | cut -c1-260
}

part_final2() {  # mHC epilogue reducing 8 partials a step; GPU tests; 32K at 128 / 256 requests; decode MoE as one op
  export PYTHONPATH=.
  logged final2_tests 150 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_mhc.py \
    tests/kernels/test_mhc_v41.py tests/engine/test_engine_static_gpu.py
  logged final2_profile 110 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200-s6b.json"
  logged final_32k 200 python3 bench/engine_h200.py --static-decode --overlap --requests 128,256 --modes none,dspark3 \
    --contexts 32768 --decode-only --steps 4 --budget-s 150 --out "$OUT/engine-h200-32k-s6.json"
  logged final_tiles 100 python3 bench/moe_decode_tiles.py --out "$OUT/moe-decode-tiles-shipped-h200.json"
  tail -n 4 $W/logs/final2_tests.txt | cut -c1-300
  grep -h "^{" $W/logs/final2_profile.txt | cut -c1-600
  grep -h '"mode"\|skip' $W/logs/final_32k.txt | cut -c1-220
  grep -h "shipped" $W/logs/final_tiles.txt | cut -c1-260
}

part_last() {  # mHC statistics back to one partial per 64 channels (4 warps unfused), chunked epilogue
  export PYTHONPATH=.
  logged last_profile 110 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200-s6c.json"
  logged last_tests 60 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_mhc.py
  grep -h "^{" $W/logs/last_profile.txt | cut -c1-500; tail -n 2 $W/logs/last_tests.txt
}

part_next() {  # after the device time ran out: the gathering compressor pool, index_scores (NOT_YET_ON_GPU)
  export PYTHONPATH=.
  logged next_tests 240 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_compressor_pool.py \
    tests/kernels/test_lightning_indexer.py tests/kernels/test_static_not_yet_kernels.py \
    tests/models/test_deepseek_v4_static_graph_gpu.py tests/engine/test_engine_static_gpu.py
  logged next_profile 130 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-h200-gather.json"
  logged next_profile_ny 130 python3 bench/graph_decode.py --requests 1,8,64 --not-yet --profile \
    --out "$OUT/graph-profile-h200-index-scores.json"
  tail -n 6 $W/logs/next_tests.txt | cut -c1-300; grep -h "^{" $W/logs/next_profile*.txt | cut -c1-500
}

part_$1
tar -C $W -cf "$OUT/logs6-$1.tar" logs
ls -la "$OUT"
