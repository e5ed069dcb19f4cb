#!/usr/bin/env bash
# GPU steps of the thirty-eighth session, for one H200 (an H100 runs them too; every JSON names its card):
#
#   run(command="bash bench/gpu_session42.sh a", carry=[".whl"])   # ≈ 7 min (+ ≈ 3 on an H200)
#   (.whl: the flashinfer wheels, see gpu_session29.sh; without them part a skips the attention step)
#
# a: 1. the decode GEMV on v4-mini's K = 512 weights (the heads' `wq_b` [16384, 512] and the indexer's
#       `wq_b` [8192, 512], on torch's matmul as shipped because the GEMV lost to cuBLAS timed alone):
#       the batch-1 and batch-8 graph steps captured with the GEMV at three tile shapes against the
#       shipped graph, timed in turn in one process (`bench/graph_decode.py --gemv-ab`); v41-mini at 1.
#    2. the v4-mini batch-1 step's kernels with PDL off (`--profile --no-pdl`), comparable with the
#       twenty-ninth session's `v4-profile-h100-s29.json`: where issue 7's step goes now.
#    3. on an H200 only (the issue's card) with .whl carried: flashinfer's MLA decode attention with the
#       sink pass at 32K for 256 and 512 requests (issue 6's 70 % row, last measured in the sixth session).
source "$(dirname "$0")/gpu_lib.sh"  # logged, tests, step, pack, dispatch, with_flashinfer

card() { nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[12]00' | tr 'H' 'h'; }

part_a() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  step "gemv-ab-v4-$(card)-s38" 240 --requests 1,8 --gemv-ab
  step "gemv-ab-v41-$(card)-s38" 200 --config v41-mini --requests 1 --gemv-ab
  grep -h "gemv_ab" "$W"/logs/gemv-ab-*.txt | cut -c1-600
  step "v4-profile-nopdl-$(card)-s38" 150 --requests 1 --profile --no-pdl
  if [ "$(card)" = h200 ] && ls .whl/*.whl > /dev/null 2>&1; then
    with_flashinfer
    logged "attn-flashinfer-32k-h200-s38" 300 python3 bench/attn_batched.py --skip-model --skip-sweep \
      --skip-per-request --batches 256,512 --out "$OUT/attn-flashinfer-32k-h200-s38.json"
    grep -h "flashinfer\|copy" "$W/logs/attn-flashinfer-32k-h200-s38.txt" | cut -c1-300
  fi
}

dispatch session42 "${1:-}"
