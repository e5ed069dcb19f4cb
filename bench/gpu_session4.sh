#!/usr/bin/env bash
# The GPU steps of the fourth 2026-11-30 session, on one warm nvidia-h200-x2 machine (two H200s).
#
# The Gemma-3 270M GGUF travels in ten 25 MiB parts (see gpu_session3.sh), one per call; every call
# stashes the part it carries into /tmp/gg and also does one piece of GPU work, so the calls that
# carry the parts are not spent idle:
#
#   run(command="bash bench/gpu_session4.sh dist", kind="nvidia-h200-x2", carry=[".gpu/gg/part00"])
#   run(command="bash bench/gpu_session4.sh kA", carry=[".gpu/gg/part01"])
#   run(command="bash bench/gpu_session4.sh kB", carry=[".gpu/gg/part02"])
#   run(command="bash bench/gpu_session4.sh stash", carry=[".gpu/gg/part03"])   # ... part08
#   run(command="bash bench/gpu_session4.sh gemma_train", carry=[".gpu/gg/part09", ".gpu/small"])
#   run(command="bash bench/gpu_session4.sh gemma_eval")
#
# dist: both GPUs — TP2 vs one GPU, the fused TP epilogue vs NCCL + torch, sharded Engram over NCCL,
#    and the fused-epilogue GPU tests (NVLink multicast off throughout).
# kA: GPU 0 the decode MoE tile sweep; GPU 1 batched decode attention (one launch for B requests).
# kB: GPU 0 grouped_wo_a at real sizes (tests, then timings); GPU 1 cross-layer mHC fusion and the
#    drafter's fused stages.
# gemma_train: GPU 0 assemble + check the GGUF, convert, train the drafter (fp32, for the greedy
#    identity check: bf16 logits tie, bench/greedy_ties.py); GPU 1 the v4-mini engine table.
# gemma_eval: GPU 0 the T = 0 cells, GPU 1 the T = 1 cells (batch 1 each), then one merged file.
set -uo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 PYTHONPATH=. NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=/tmp/gpu-session && mkdir -p $W/logs /tmp/gg /tmp/gemma
GEMMA_MODEL=/tmp/gemma/model
GEMMA_DRAFTER=/tmp/gemma/drafter

stash() {
  for f in .gpu/gg/part*; do [ -f "$f" ] && cp -n "$f" /tmp/gg/; done
  ls /tmp/gg | tr '\n' ' '; echo
}

logged() {  # logged NAME TIMEOUT CMD...: run CMD under a timeout into $W/logs/NAME.txt, record rc
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$W/logs/$name.txt" 2>&1
  echo "$name rc=$?" | tee -a "$W/logs/$name.txt"
}

part_dist() {
  logged tp_x2 150 torchrun --nproc-per-node 2 bench/dist_tp_x2.py
  logged tp_fused_x2 150 torchrun --nproc-per-node 2 bench/dist_tp_fused_x2.py
  logged engram_nccl 100 torchrun --nproc-per-node 2 bench/engram_shard_nccl.py
  logged fused_gpu_tests 100 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_dist_fused_gpu.py -rs
  tail -n 6 $W/logs/*.txt | cut -c1-300
}

part_kA() {
  (export CUDA_VISIBLE_DEVICES=0; logged tiles 200 python3 bench/moe_decode_tiles.py --out "$OUT/moe-decode-tiles-h200.json") &
  (export CUDA_VISIBLE_DEVICES=1; logged attn_batched 240 python3 bench/attn_batched.py --out "$OUT/attn-batched-h200.json") &
  wait
  tail -n 12 $W/logs/tiles.txt $W/logs/attn_batched.txt | cut -c1-300
}

part_kB() {
  (
    export CUDA_VISIBLE_DEVICES=0
    logged wo_a_tests 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_grouped_wo_a.py -rs
    logged wo_a_bench 120 python3 bench/kernels.py --configs flash,mini --ops grouped_wo_a --model-steps 0 \
      --out "$OUT/kernels-wo-a-h200.json"
  ) &
  (
    export CUDA_VISIBLE_DEVICES=1
    logged mhc_boundaries 130 python3 bench/mhc_boundaries.py --out "$OUT/mhc-boundaries-h200.json"
    logged draft_kernels 150 python3 bench/draft_kernels.py --out "$OUT/draft-kernels-h200.json"
  ) &
  wait
  tail -n 8 $W/logs/wo_a_*.txt $W/logs/mhc_boundaries.txt $W/logs/draft_kernels.txt | cut -c1-300
}

part_stash() { :; }

part_dist2() {  # the two distributed runs that the first `dist` cut short (timeout) or stopped (lookup under autograd)
  logged tp_x2 330 torchrun --nproc-per-node 2 bench/dist_tp_x2.py
  logged engram_nccl 120 torchrun --nproc-per-node 2 bench/engram_shard_nccl.py
  tail -n 4 $W/logs/tp_x2.txt $W/logs/engram_nccl.txt | cut -c1-300
}

part_gemma_train() {
  (export CUDA_VISIBLE_DEVICES=1; logged engine 340 python3 bench/engine_h200.py --budget-s 290 --out "$OUT/engine-h200-s4.json") &
  (
    export CUDA_VISIBLE_DEVICES=0
    cat /tmp/gg/part* > /tmp/gemma/gemma-3-270m-q4_k_m.gguf
    echo "$(cat .gpu/small/gguf.sha256)  /tmp/gemma/gemma-3-270m-q4_k_m.gguf" | sha256sum -c - || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/small/*.whl || exit 1
    export PYTHONPATH=.:/tmp/site
    logged convert 240 python3 -c "from dspark.models.hf_causal.gguf import convert_gguf as c; c('/tmp/gemma/gemma-3-270m-q4_k_m.gguf', '$GEMMA_MODEL')"
    if [ ! -f $GEMMA_MODEL/tokenizer.json ] && [ -f $GEMMA_MODEL/model.safetensors ]; then  # this transformers' GGUF tokenizer path failed
      gunzip -c .gpu/small/tokenizer.json.gz > $GEMMA_MODEL/tokenizer.json && cp .gpu/small/tokenizer_config.json $GEMMA_MODEL/
      echo "tokenizer: the one converted on the CPU machine (transformers 5.23)" | tee -a $W/logs/convert.txt
    fi
    [ -f $GEMMA_MODEL/model.safetensors ] || exit 1
    logged gemma_train ${GEMMA_TRAIN_S:-300} python3 bench/hf_gemma.py --model $GEMMA_MODEL --device cuda --threads 4 \
      --phase train --dtype float32 --drafter-dir $GEMMA_DRAFTER --train-dir .gpu/small/eval --out /tmp/gemma/unused.json \
      --train-prompts 16 --calib-prompts 3 --distill-tokens 96 --steps 300 --batch-size 8 --micro-batch 8 \
      --cache-target --num-anchors 32 --markov-rank 256 --calib-tokens 64
    cp $GEMMA_DRAFTER/hf-gemma-summary.json "$OUT/" 2>/dev/null
  ) &
  wait
  tr '\r' '\n' < $W/logs/gemma_train.txt | grep -v "^\s*$" | tail -n 8 | cut -c1-1500
  tail -n 12 $W/logs/engine.txt | cut -c1-300
}

part_gemma_eval() {
  export PYTHONPATH=.:/tmp/site
  for t in 0 1; do
    (export CUDA_VISIBLE_DEVICES=$t; logged gemma_eval_t$t ${GEMMA_EVAL_S:-300} python3 bench/hf_gemma.py --model $GEMMA_MODEL \
       --device cuda --threads 4 --phase eval --drafter-dir $GEMMA_DRAFTER --limit 4 --max-new-tokens 96 \
       --dtype float32 --temperatures $t --out "$OUT/hf-gemma-h200-t$t.json") &
  done
  wait
  python3 bench/hf_gemma.py --merge "$OUT/hf-gemma-h200-t0.json" "$OUT/hf-gemma-h200-t1.json" --out "$OUT/hf-gemma-h200.json"
  grep -h '"method"' $W/logs/gemma_eval_t*.txt | cut -c1-220
}

stash
part_$1
tar -C $W -cf "$OUT/logs-$1.tar" logs
ls -la "$OUT"
