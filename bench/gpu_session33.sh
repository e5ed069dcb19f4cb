#!/usr/bin/env bash
# GPU steps of the thirty-second session, for one H200 (the issue's card) or an H100 (every JSON names
# its card; `*_pct_copy` fields judge a card by its own measured copy bandwidth):
#
#   run(command="bash bench/gpu_session33.sh a", carry=[".whl"])   # ≈ 5 min
#   (.whl: `pip download --no-deps flashinfer-python==0.6.18.post1 apache-tvm-ffi==0.1.15.post2
#    --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 -d .whl`)
#
# a: the attention sink folded into `grouped_wo_a` (`SinkGate`: each head's fp32 part of the projection
#    scaled by sigmoid(lse − sink), in place of the sink pass over flashinfer's output; the twenty-fourth
#    session's fold scaled the operand tiles instead and lost 1.3x at 512 rows, fe4735c):
#    the GPU tests of both ops and of the sink (flashinfer's `unsunk`, real wo_a shapes with the gate),
#    then `bench/attn_batched.py`'s flashinfer rows at 32K for 64, 256 and 512 requests, each with its
#    `fold_*` fields: the attention + wo_a with the sink pass, with the fold, and wo_a alone, in turn
#    over 3 rounds (issue 6's decode attention at 32K: 61-63 % of HBM with the pass, 71-73 % for
#    flashinfer's kernel alone, in the sixth session).
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, pack, dispatch, with_flashinfer

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  with_flashinfer
  tests a_tests 200 tests/kernels/test_grouped_wo_a.py tests/kernels/test_attention_sink.py \
    tests/kernels/test_attention_flashinfer.py tests/kernels/test_sink_fold_model.py
  logged a_attn 300 python3 bench/attn_batched.py --skip-model --skip-sweep --skip-per-request --batches 64,256,512 \
    --out "$OUT/attn-fold.json"
  grep -h "flashinfer\|sink folded\|copy" "$W/logs/a_attn.txt" | cut -c1-300; tail -n 1 "$W/logs/a_attn.txt"
}

dispatch session33 "${1:-}"
