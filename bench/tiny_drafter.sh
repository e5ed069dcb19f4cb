#!/usr/bin/env bash
# dspark-tiny drafter, second round, on one H200 in one device call (< 10 min), from the repo root:
#
#   here (CPU, once): python bench/tiny_drafter.py prompts --out tiny-data/v2
#   device tool:      run(command="bash bench/tiny_drafter.sh", carry=["tiny-data/v2"], timeout_s=600)
#
# 1. the frozen target continues 2304 training prompts (256 new tokens; 2 of 3 batches greedy, 1 at
#    T = 1) for at most GEN_S seconds -> $OUT/selfdistill.jsonl
# 2. three recipes (bench/tiny_drafter.py RECIPES) continue the shipped drafter at once on the one GPU
#    (a small model leaves it mostly idle, so three processes share it well), TRAIN_S seconds each
# 3. each drafter and the shipped one decode the 48 held-out prompts: τ per domain, T and budget
# Returns one tar per drafter (bf16 matrices, like the shipped one), the eval JSONs and the logs.
set -euo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
GEN_S=${GEN_S:-130} TRAIN_S=${TRAIN_S:-220}
W=/tmp/tiny-drafter && mkdir -p $W/logs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $W/logs/gpu.txt
python3 bench/tiny_drafter.py gen --out "$OUT/selfdistill.jsonl" --seconds "$GEN_S" 2>&1 | tee $W/logs/gen.log
for r in paper ce ce-greedy; do
  python3 bench/tiny_drafter.py train --data "$OUT/selfdistill.jsonl" --out $W/drafter-$r --recipe $r \
    --seconds "$TRAIN_S" > $W/logs/train-$r.log 2>&1 &
done
wait
tail -n 2 $W/logs/train-*.log
for d in dspark/assets/dspark-tiny/drafter $W/drafter-paper $W/drafter-ce $W/drafter-ce-greedy; do
  python3 bench/tiny_drafter.py eval --drafters $d --out $W/logs/eval-$(basename $d).json > $W/logs/eval-$(basename $d).log 2>&1 &
done
wait
python3 - <<'PY'
import json, glob
for path in sorted(glob.glob("/tmp/tiny-drafter/logs/eval-*.json")):
    for d, runs in json.load(open(path))["drafters"].items():
        print(d, [(r["domain"], r["temperature"], r["budget"], round(r["tau"], 2)) for r in runs])
PY
python3 bench/tiny_drafter.py ship $W/drafter-paper $W/drafter-ce $W/drafter-ce-greedy
for r in paper ce ce-greedy; do tar -C $W -cf "$OUT/drafter-$r.tar" drafter-$r; done
tar -C $W -cf "$OUT/logs.tar" logs
ls -la "$OUT"
