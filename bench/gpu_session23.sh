#!/usr/bin/env bash
# GPU steps of the twenty-third session (one H200 or H100; each part under the 10-minute call limit).
# flashinfer travels as wheels in .whl/ (flashinfer-python==0.6.18.post1, apache-tvm-ffi==0.1.15.post2,
# `pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64`):
#
#   run(command="bash bench/gpu_session23.sh a", carry=[".whl"])   # ≈ 7 min
#   run(command="bash bench/gpu_session22.sh c")                   # ≈ 4 min, on an H200 only
#
# a: the sink of flashinfer's attention deferred to the projection after it (`SparseAttentionFlashinfer.
#    deferred` / `run_deferred` + `grouped_wo_a(..., head_scale=)`: no pass over the attention output).
#    The GPU tests of flashinfer's op, of `grouped_wo_a` and of the model's batched attention (the
#    deferred path bit for bit against the sink pass at V4-Flash and v4-mini shapes), then
#    `bench/attn_batched.py` at 32K for 64..512 requests: flashinfer's kernel alone, with the sink pass,
#    and each followed by `wo_a` in one graph (attention cost = pair − `wo_a` alone, both ways), % of
#    4.4 TB/s and of this card's measured copy bandwidth.
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

dispatch session23 "${1:-}"
