#!/usr/bin/env bash
# dspark-tiny drafter, second round, on the H200 (device tool), from the repo root. Two calls:
#
#   here (CPU, once): python bench/tiny_drafter.py prompts --out tiny-data/v2
#   1. run(command="bash bench/tiny_drafter.sh gen", carry=["tiny-data/v2"], timeout_s=600)
#      the frozen target continues the first 384 shuffled training prompts greedily (256 new tokens):
#      one engine batch, 530 s on one H200 (the reference path, no graphs) -> $OUT/selfdistill.jsonl,
#      which goes to tiny-data/v2/selfdistill-greedy384.jsonl here
#   2. run(command="bash bench/tiny_drafter.sh train", carry=["tiny-data/v2"], timeout_s=600)
#      (ran as part a of bench/gpu_session.sh, on GPU 1) three recipes (bench/tiny_drafter.py RECIPES)
#      continue the first-round drafter at once on the one GPU (a small model leaves it mostly idle),
#      150 s each; then each drafter and the first-round one decode the 48 held-out prompts (τ per
#      domain, T and budget); drafters come back as one tar each (bf16 matrices, as shipped).
set -uo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
W=${W:-/tmp/tiny-drafter} && mkdir -p $W/logs
DATA=tiny-data/v2/selfdistill-greedy384.jsonl

case "${1:?gen or train}" in
  gen)
    python3 bench/tiny_drafter.py gen --out "$OUT/selfdistill.jsonl" --seconds 1 ;;
  train)
    # start from the first-round drafter (the shipped one before this round replaced it)
    mkdir -p $W/first-round
    for f in config.json model.safetensors; do
      git show 8e32f36:dspark/assets/dspark-tiny/drafter/$f > $W/first-round/$f
    done
    for r in paper ce ce-lr; do
      python3 bench/tiny_drafter.py train --data $DATA --out $W/drafter-$r --recipe $r --seconds 150 \
        --init-from $W/first-round > $W/logs/train-$r.log 2>&1 &
    done
    wait
    for d in $W/first-round $W/drafter-paper $W/drafter-ce $W/drafter-ce-lr; do
      python3 bench/tiny_drafter.py eval --drafters $d --out $W/logs/eval-$(basename $d).json \
        > $W/logs/eval-$(basename $d).log 2>&1 &
    done
    wait
    python3 bench/tiny_drafter.py ship $W/drafter-paper $W/drafter-ce $W/drafter-ce-lr
    for r in paper ce ce-lr; do tar -C $W -cf "$OUT/drafter-$r.tar" drafter-$r; done ;;
esac
