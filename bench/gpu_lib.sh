# Shared by the GPU session scripts: `source "$(dirname "$0")/gpu_lib.sh"` first. It sets the shell
# options, checks OUT (the folder whose files come back), exports the Python settings and makes the
# log folder W (a script may set W before sourcing, else /tmp/gpu-session).
set -uo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
W=${W:-/tmp/gpu-session} && mkdir -p "$W/logs"

card() {  # h100 or h200: the card this call got, for result names
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o 'H[12]00' | tr 'H' 'h'
}

logged() {  # logged NAME TIMEOUT CMD...: run CMD under a timeout into $W/logs/NAME.txt, record rc
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$W/logs/$name.txt" 2>&1
  echo "$name rc=$?" | tee -a "$W/logs/$name.txt"
}

step() {  # step NAME TIMEOUT ARGS...: bench/graph_decode.py into $OUT/NAME.json, its timing / profile lines shown
  local name=$1 limit=$2; shift 2
  logged "$name" "$limit" python3 bench/graph_decode.py "$@" --out "$OUT/$name.json"
  grep -h "graph_ms\|\"profile\"\|torch_ops" "$W/logs/$name.txt" | cut -c1-900; tail -n 2 "$W/logs/$name.txt" | cut -c1-200
}

tests() {  # tests NAME TIMEOUT PYTEST-ARGS...: pytest quietly, its summary and failures shown
  local name=$1 limit=$2; shift 2
  logged "$name" "$limit" python3 -m pytest -q -p no:cacheprovider -rs "$@"
  tail -n 3 "$W/logs/$name.txt" | cut -c1-400; grep -h "^E  \|FAILED" "$W/logs/$name.txt" | head -n 12 | cut -c1-300
}

pack() {  # pack NAME: the logs into $OUT, then all of $OUT into one NAME.tgz (a call returns at most 8 files)
  cp "$W"/logs/*.txt "$OUT/" 2>/dev/null || true
  (cd "$OUT" && tar czf "/tmp/$1.tgz" . && find . -type f -delete && mv "/tmp/$1.tgz" .)
}

dispatch() {  # dispatch SESSION PART: run the script's function part_PART, then pack $OUT as SESSION-PART.tgz
  local session=$1 part=${2:?which part to run}
  declare -F "part_$part" > /dev/null || { echo "unknown part $part" >&2; exit 2; }
  "part_$part"
  pack "$session-$part"
}

with_flashinfer() {  # the wheels carried in .whl/ onto PYTHONPATH, nvcc for flashinfer's JIT
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:. FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
  local nvcc; nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
  [ -n "$nvcc" ] && export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")} PATH=$(dirname "$nvcc"):$PATH
  echo "nvcc: ${nvcc:-none}; CUDA_HOME=${CUDA_HOME:-unset}"; python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
}

swap() {  # swap new|old FILE...: the kernel files as this commit has them (kept in /tmp on the first
  # swap), or as .ab/<name>_old.py has them
  local side=$1 f name; shift
  for f in "$@"; do
    name=$(basename "$f" .py)
    [ -f "/tmp/${name}_new.py" ] || cp "$f" "/tmp/${name}_new.py"
    if [ "$side" = old ]; then cp ".ab/${name}_old.py" "$f"; else cp "/tmp/${name}_new.py" "$f"; fi
  done
}

ab_rounds() {  # ab_rounds PART V41_ROUNDS V4_ROUNDS SIDE-FN STEP-ARGS...: two rounds of "new" then "old"
  # (SIDE-FN new|old puts that side in place), each the v41-mini graph step in its first V41_ROUNDS rounds
  # and the v4-mini one in its first V4_ROUNDS, at 1 and 8 requests
  local part=$1 v41=$2 v4=$3 side_fn=$4 round side; shift 4
  for round in 1 2; do
    for side in new old; do
      "$side_fn" "$side"
      if [ "$round" -le "$v41" ]; then step "${part}_v41_${side}_$round" 100 --config v41-mini --requests 1,8 "$@"; fi
      if [ "$round" -le "$v4" ]; then step "${part}_v4_${side}_$round" 80 --requests 1,8 "$@"; fi
    done
  done
}

ab_steps() {  # ab_steps PART V4_ROUNDS FILE...: `ab_rounds` with FILEs as committed ("new") and as .ab has
  # them ("old"); AB_V41_ROUNDS (default 2) caps the v41-mini rounds, 0 for a short call
  local part=$1 v4_rounds=$2; shift 2
  AB_FILES=("$@")
  ab_rounds "$part" "${AB_V41_ROUNDS:-2}" "$v4_rounds" _swap_ab_files
  swap new "$@"
}

_swap_ab_files() { swap "$1" "${AB_FILES[@]}"; }

ab_trees() {  # ab_trees PART V41_ROUNDS V4_ROUNDS STEP-ARGS...: `ab_rounds` with this tree's dspark ("new")
  # and with the package copied into .ab/main ("old", first on PYTHONPATH): a whole commit against
  # another, where `ab_steps` swaps single files
  local path=$PYTHONPATH
  ab_rounds "$1" "$2" "$3" _python_path_ab "${@:4}"
  export PYTHONPATH=$path
}

_python_path_ab() {  # the side's package first on PYTHONPATH, and where a script imports it from (-P: not cwd)
  if [ "$1" = old ]; then export PYTHONPATH=.ab/main:.; else export PYTHONPATH=.; fi
  python3 -P -c "import dspark; print('$1: dspark from', dspark.__file__)"
}

moe_rows_h200() {  # moe_rows_h200 SESSION [FLUSH]: on an H200 only (issue 6's card), issue 6's V4-Flash MoE rows
  # (the whole op with the router at 1, 8 and 64 tokens, graphed) into $OUT/kernels-moe-graph-h200-SESSION.json,
  # or with FLUSH (`bench/kernels.py --flush`: read, the default, or write) $OUT/kernels-moe-graph-FLUSH-h200-SESSION.json
  local name=moe_rows${2:+_$2} out=kernels-moe-graph${2:+-$2}-h200-$1.json
  nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
  if [ "$(card)" = h200 ]; then
    logged "$name" 240 python3 bench/kernels.py --configs flash --tokens 1,8,64 --model-steps 0 --graph \
      ${2:+--flush "$2"} --ops fused_moe,fused_moe_fp8_128,fused_moe_fp8_32 --out "$OUT/$out"
    grep -h "fused_moe" "$W/logs/$name.txt" | cut -c1-200
  fi
}

issue6_h200_or() {  # issue6_h200_or TAG FALLBACK: on an H200, issue 6's deciding figures (the MoE rows after the read
  # flush, the 32K decode attention on flashinfer, the MoE rows after the write flush); on an H100, FALLBACK
  if [ "$(card)" = h200 ]; then
    moe_rows_h200 "$1"
    attention_32k "$1"
    moe_rows_h200 "$1" write
  else
    "$2"
  fi
}

tma_tests_then_early() {  # tma_tests_then_early TESTS EARLY: the TMA kernels' GPU tests (log TESTS), then issue 6's
  # whole op at one token for the three weight kinds, V4-Flash, as shipped, late and as two launches with their early
  # rows (`bench/moe_decode_tma.py --early`) into $OUT/EARLY.json
  tests "$1" 240 tests/kernels/test_moe_decode_tma.py
  logged "$2" 200 python3 bench/moe_decode_tma.py --early --layers v4-flash --kinds fp8,fp8-32,bf16 --tokens 1 \
    --out "$OUT/$2.json"
  grep -h "early" "$W/logs/$2.txt" | cut -c1-300 | tail -n 4
}

ncu_bin() { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1; }

ncu_experts() {  # ncu_experts NAME ARGS...: bench/moe_decode_ncu.py ARGS under Nsight Compute into $OUT/NAME.csv
  local name=$1 ncu; shift
  ncu=$(ncu_bin)
  [ -n "$ncu" ] || { echo "no ncu on this machine"; return 0; }
  logged "$name" 150 "$ncu" --clock-control none --profile-from-start off --csv --page details \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis python3 bench/moe_decode_ncu.py "$@"
  grep -h "\"Duration\"\|DRAM Throughput\|Achieved Occupancy\|Theoretical Occupancy\|Waves Per SM\|Block Limit\|Registers Per\|No Eligible\|Warp Cycles Per Issued\|relative difference" \
    "$W/logs/$name.txt" | awk -F'","' '{print $5, "|", $13, "|", $15}' | cut -c1-160 | head -n 40
  mv "$W/logs/$name.txt" "$OUT/$name.csv"
}

attention_32k() {  # attention_32k TAG: flashinfer's MLA decode attention + the sink pass at 32K, 256 and 512 requests
  # (needs .whl carried), into $OUT/attn-flashinfer-32k-CARD-TAG.json
  ls .whl/*.whl > /dev/null 2>&1 || { echo "no .whl: attention step skipped"; return; }
  with_flashinfer
  local name; name="attn-flashinfer-32k-$(card)-$1"
  logged "$name" 330 python3 bench/attn_batched.py --skip-model --skip-sweep --skip-per-request --batches 256,512 \
    --out "$OUT/$name.json"
  grep -h "flashinfer\|copy\|read flush" "$W/logs/$name.txt" | cut -c1-300
}
