#!/usr/bin/env bash
# Train dspark-tiny's DSpark drafter on one H200 in one device call (≤ 10 min), from the repo root:
#
#   here (CPU, once): the target checkpoint in tiny-data/ckpt/dspark-tiny (bench/train_tiny.sh output) and
#                     tiny-data/draft/train.jsonl (3000 packed 512-token training rows as input_ids)
#   device tool:      run(command="bash bench/train_tiny_drafter.sh", carry=["tiny-data/ckpt", "tiny-data/draft"])
#
# The drafter (3 stages = inputs of target layers 3, 4, 5; γ = 5; Markov rank 64; 4 routed experts
# top-2 per stage) trains online against the frozen target (spec §5) and is saved every 50 steps, so a
# run cut by the time limit still returns its last save. Writes $OUT/dspark-tiny-drafter/ and $OUT/train.log.
set -euo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv,noheader || true
timeout 470 python3 -m dspark.cli train-draft --model tiny-data/ckpt/dspark-tiny --data tiny-data/draft/train.jsonl \
  --out "$OUT/dspark-tiny-drafter" --steps 400 --batch-size 16 --num-anchors 64 --lr 1e-3 \
  --save-every 50 --seed 0 --block-size 5 --target-layers 3,4,5 --markov-rank 64 --noise-token-id 3 \
  --n-routed-experts 4 --n-activated-experts 2 --max-length 512 --device cuda 2>&1 | tee "$OUT/train.log" || true
ls -la "$OUT/dspark-tiny-drafter"
