#!/usr/bin/env bash
# GPU steps of the twenty-fifth session, for one H200 (an H100 runs them too; every JSON names its card):
#
#   run(command="bash bench/gpu_session25.sh a", carry=[".whl"])   # ≈ 6 min (flashinfer JIT compiles)
#
# a: flashinfer's attention-sink variant (`SparseAttentionFlashinferSink`: the FA2 batch prefill kernel,
#    head_dim 512, the sink inside the kernel) against the MLA kernels + sink pass, both timed in one
#    process at 32K context, 1 / 8 / 64 / 128 / 256 / 512 requests (`bench/attn_batched.py --flashinfer
#    mla,fa2_sink`); then both paths' GPU tests against the reference.
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, with_flashinfer

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  with_flashinfer
  logged a_attn 420 python3 bench/attn_batched.py --skip-model --skip-sweep --skip-per-request --skip-triton \
    --flashinfer mla,fa2_sink --batches 1,8,64,128,256,512 --out "$OUT/attn-fa2-sink.json"
  grep -h "attn_flashinfer\|wrote\|Error\|error" "$W/logs/a_attn.txt" | cut -c1-260 | tail -n 60
  tests a_tests 120 tests/kernels/test_attention_flashinfer.py -m gpu
}

dispatch session25 "${1:-}"
