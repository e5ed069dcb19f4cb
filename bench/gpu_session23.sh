#!/usr/bin/env bash
# GPU steps written in the twenty-third session (one H200 or H100; each part under the 10-minute call
# limit). Parts a, b and c ran in the twenty-fourth session on one H100 (bench/README.md).
# flashinfer travels as wheels in .whl/ (flashinfer-python==0.6.18.post1, apache-tvm-ffi==0.1.15.post2,
# `pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64`):
#
#   run(command="bash bench/gpu_session23.sh a", carry=[".whl"])   # ≈ 7 min
#   run(command="bash bench/gpu_session23.sh b")                   # ≈ 6 min
#   run(command="bash bench/gpu_session23.sh c")                   # ≈ 5 min
#   run(command="bash bench/gpu_session22.sh c")                   # ≈ 4 min, on an H200 only
#
# a: (deferred sink: slower on the H100, removed after this ran) the sink of flashinfer's attention deferred to the projection after it (`SparseAttentionFlashinfer.
#    deferred` / `run_deferred` + `grouped_wo_a(..., head_scale=)`: no pass over the attention output).
#    The GPU tests of flashinfer's op, of `grouped_wo_a` and of the model's batched attention (the
#    deferred path bit for bit against the sink pass at V4-Flash and v4-mini shapes), then
#    `bench/attn_batched.py` at 32K for 64..512 requests: flashinfer's kernel alone, with the sink pass,
#    and each followed by `wo_a` in one graph (attention cost = pair − `wo_a` alone, both ways), % of
#    4.4 TB/s and of this card's measured copy bandwidth.
# b: each layer's compressors and its kv projection on side CUDA streams beside its q projection
#    (`StaticDecoder(..., side_streams=2)`; `dspark/models/deepseek_v4/side_stream.py`, whose DEFAULT_LANES
#    stays 0 until this part has run: set it from the timings below where the lanes win): the
#    GPU tests of the static step graphs (V4, V4.1: 2, 1 and 0 side streams bit for bit, graph == eager
#    without sync), then `bench/graph_decode.py --side-ab` (the graphs of decoders with 2, 1 and 0 side
#    streams over the same state, timed in turn in one process; against the dynamic path too): v4-mini
#    at 1 and 8 requests, the 4-token verify block at 1, v41-mini at 1.
# c: the GPU tests of the engine on graphs: run after DEFAULT_LANES is set from part b (the engine's
#    static steps then fork and join the side streams).
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, with_flashinfer

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  with_flashinfer
  tests a_tests 300 tests/kernels/test_attention_flashinfer.py tests/kernels/test_grouped_wo_a.py \
    tests/models/test_deepseek_v4_batched_attention.py
  logged a_attn 300 python3 bench/attn_batched.py --skip-model --skip-sweep --skip-per-request \
    --batches 64,128,256,512 --out "$OUT/attn-deferred-sink.json"
  grep -h "flashinfer\|wo_a\|copy" "$W/logs/a_attn.txt" | cut -c1-300; tail -n 1 "$W/logs/a_attn.txt"
}

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  tests b_tests 150 tests/models/test_deepseek_v4_static_graph_gpu.py tests/models_v41/test_deepseek_v41_static_graph_gpu.py
  step b_side 160 --requests 1,8 --side-ab
  step b_side_verify 120 --requests 1 --tokens 4 --side-ab
  step b_side_v41 120 --config v41-mini --requests 1 --side-ab
}

part_c() {
  tests c_tests 400 tests/engine -m gpu
}

dispatch session23 "${1:-}"
