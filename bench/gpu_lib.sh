# Shared by the GPU session scripts (`source bench/gpu_lib.sh` after setting W, the log folder).

logged() {  # logged NAME TIMEOUT CMD...: run CMD under a timeout into $W/logs/NAME.txt, record rc
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$W/logs/$name.txt" 2>&1
  echo "$name rc=$?" | tee -a "$W/logs/$name.txt"
}
