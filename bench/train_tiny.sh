#!/usr/bin/env bash
# Pretrain dspark-tiny on one H200 in one device call (≤ 10 min), from the repository root:
#
#   here (CPU, once):  python -m dspark.tiny.corpus && python -m dspark.tiny.tokenizer && python -m dspark.tiny.packing
#   device tool:       run(command="bash bench/train_tiny.sh 7", carry=["tiny-data/packed", "tiny-data/tokenizer"],
#                          timeout_s=600)
#
# The GPU machine has torch, transformers and tokenizers but no internet, so the corpus, tokenizer
# and packed rows are built here and carried (tiny-data/ is git-ignored; ~9 MB). Writes, under $OUT
# (at most 8 files of ≤ 16 MiB come back, which the bf16 save with 15 MiB shards respects):
#   $OUT/dspark-tiny/   config.json, model-0000i-of-0000N.safetensors, model.safetensors.index.json,
#                       tokenizer.json, tokenizer_config.json, pretrain.json (held-out losses, settings)
#   $OUT/train.log      the run's log: conditions, held-out losses as they come, the load check
# Argument: the pretraining budget in whole minutes (default 7; the rest of the 10 minutes covers
# install, imports and the load check; the final evaluation and the save fit in the budget's reserve).
set -euo pipefail
MINUTES="${1:-7}"
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1
for f in tiny-data/packed/packing.json tiny-data/tokenizer/tokenizer.json; do
  [ -f "$f" ] || { echo "missing $f: build it on the CPU machine and carry tiny-data/ (docs/dspark-tiny.md)"; exit 2; }
done

pretrain() {  # precision, minutes
  python3 -m dspark.tiny.pretrain --config dspark-tiny --data tiny-data/packed --tokenizer tiny-data/tokenizer \
    --out "$OUT/dspark-tiny" --device cuda --precision "$1" --max-minutes "$2" --steps 100000 --batch-size 32 \
    --lr 3e-3 --warmup-steps 100 --eval-every 100 --eval-rows 64 --save-dtype bfloat16 --no-progress
}

main() {
  echo "== conditions"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,power.limit --format=csv,noheader || true
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) (+ working tree), budget ${MINUTES} min"
  # No index, no build isolation: nothing can be fetched there. Modules run from the repository root
  # import the same sources even if this install failed, so a failure is reported, not fatal.
  python3 -m pip install -q --no-deps --no-build-isolation --no-index . \
    || echo "pip install failed; using the source tree"
  python3 -c "import torch, transformers, tokenizers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
  'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)"
  python3 -c "import json; d = json.load(open('tiny-data/packed/packing.json')); \
print('packed', {k: v['rows'] for k, v in d['files'].items()}, 'seq_len', d['seq_len'])"

  echo "== pretrain"
  # bf16 autocast first. It has never run on a GPU before this script, and a CUDA-only autocast
  # dtype mismatch would stop it within its first step: then the remaining budget goes to fp32
  # (at this size a step is launch-bound, so fp32 costs little).
  local deadline=$((SECONDS + ${MINUTES%.*} * 60))
  if ! pretrain bf16 "$MINUTES"; then
    local left=$(( (deadline - SECONDS) / 60 ))
    [ "$left" -ge 2 ] || { echo "bf16 run failed with ${left} min left: no retry"; return 1; }
    echo "bf16 run failed; retrying in fp32 for ${left} min"
    pretrain fp32 "$left"
  fi

  echo "== load check: held-out CE as trained and with cache QAT (GPU), then CPU decoding"
  python3 - "$OUT/dspark-tiny" <<'PY'
import json, sys, time
import torch
import dspark
from dspark.api import MODEL_FAMILIES
from dspark.tiny.packing import load_packed
from dspark.tiny.pretrain import evaluate
path = sys.argv[1]
metrics = json.load(open(f"{path}/pretrain.json"))
data = load_packed("tiny-data/packed")
accepted = MODEL_FAMILIES[metrics["model_config"]["model_type"]].options
# One call per 512-token row needs prefill_mode "exact" (bounded replay skips rows); the second pass
# turns the V4.1 cache QAT back on, as `load_model` does by default, to show what it costs.
for label, options in (("as trained", metrics["model_options"]), ("cache QAT on", {"prefill_mode": "exact"})):
    gpu = dspark.load_model(path, device="cuda", **{k: v for k, v in options.items() if k in accepted})
    rows = {d: r[:: max(1, len(r) // 64)] for d, r in data.heldout.items()}
    # "fp32": no autocast over the natively bf16 GPU model, the inference path users take.
    print(f"held-out CE, {label} {options}:", {d: round(evaluate(gpu, r, 16, "fp32"), 4) for d, r in rows.items()})
    del gpu
torch.set_num_threads(2)
model = dspark.load_model(path)
print("steps", metrics["steps"], "tokens", metrics["tokens"], "tok/s", metrics["tokens_per_s"],
      "stopped by", metrics["stopped_by"], "final held-out", metrics["final_heldout"])
for prompt in ("def read_config(path):\n", "Ham.\nTo be"):
    start = time.perf_counter()
    out = dspark.generate(model, prompt, max_new_tokens=48)
    rate = out.stats.new_tokens / (time.perf_counter() - start)
    print(f"--- {prompt!r} ({out.stats.new_tokens} tokens, {rate:.1f} tok/s)")
    print(prompt + out.text)
PY
  ls -la "$OUT" "$OUT/dspark-tiny"
}

set -o pipefail
main 2>&1 | tee "$OUT/train.log"
