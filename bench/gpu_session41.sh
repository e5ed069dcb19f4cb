#!/usr/bin/env bash
# GPU steps of the thirty-seventh session, for one H200 (an H100 runs them too; every JSON names its card):
#
#   run(command="bash bench/gpu_session41.sh a")   # ≈ 4 min
#   run(command="bash bench/gpu_session41.sh b")   # ≈ 2 min: a's PDL-on profile alone
#
# a: the v4-mini batch-1 graph step's kernels on the current tree (`bench/graph_decode.py --profile`, as
#    `gpu_session30.sh a` did at 284cc41 in the twenty-ninth session), with PDL off (comparable with that
#    run) and on (as shipped): where issue 7's 1.125 ms step goes now.
source "$(dirname "$0")/gpu_lib.sh"  # card, logged, tests, step, pack, dispatch

part_b() {
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  step "v4-profile-pdl-$(card)-s37" 150 --requests 1 --profile
}

part_a() {
  part_b
  step "v4-profile-nopdl-$(card)-s37" 150 --requests 1 --profile --no-pdl
}

dispatch session41 "${1:-}"
