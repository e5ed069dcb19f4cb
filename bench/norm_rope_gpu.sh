#!/usr/bin/env bash
# GPU checks of the fused RMSNorm / RoPE ops (dspark/kernels/rms_norm.py, rope.py), one H200, < 8 min:
#
#   run(command="bash bench/norm_rope_gpu.sh", kind="nvidia-h200")
#
# 1. tests (≤ 180 s): the ops at V4 sizes (RoPE bit for bit, RMSNorm within 1 ulp and against fp64),
#    their CUDA-graph replay, the whole v4-mini / tiny-v41 bf16 models with every op fused against the
#    fp32 reference, the DSpark stages fused vs reference, the V4 static step's graph replay.
#    Log: $OUT/norm-rope-tests.txt, summary: $OUT/norm-rope-tests.json.
# 2. bench/kernels.py --ops rms_norm,rms_norm_q,rope_q (≤ 60 s): fused vs reference µs per call at
#    M = 1 .. 4096 rows, V4-Flash and v4-mini layers -> $OUT/kernels-norm-rope-h200.json.
# 3. bench/graph_decode.py --requests 1,8 --profile (≤ 200 s): the v4-mini graph-replayed decode
#    step with the norms and RoPE fused -> $OUT/graph-profile-norm-rope-h200.json; compare
#    launches_per_step and kernel_us_per_step with bench/results/graph-profile-h200.json
#    (2430 launches, 5.59 ms of kernels per step at 1 request).
set -uo pipefail
: "${OUT:?OUT must name the folder to write results into}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.

timeout 180 python3 -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT/norm-rope-tests.xml" \
  tests/kernels/test_kernels_norm_rope.py "tests/kernels/test_cuda_graphs.py::test_norm_and_rope_replay" \
  "tests/kernels/test_kernels_model.py::test_fused_matches_reference_on_gpu" tests/kernels/test_draft_stage_kernels.py \
  tests/models/test_deepseek_v4_static_graph_gpu.py > "$OUT/norm-rope-tests.txt" 2>&1
echo "tests rc=$?" | tee -a "$OUT/norm-rope-tests.txt"
python3 - "$OUT" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
try:
    suite = ET.parse(f"{out}/norm-rope-tests.xml").getroot().iter("testsuite").__next__()
    summary = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["time_s"] = float(suite.get("time", 0))
    summary["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None]
except (OSError, ET.ParseError, StopIteration) as e:
    summary = {"error": repr(e)}
json.dump(summary, open(f"{out}/norm-rope-tests.json", "w"), indent=1)
print(json.dumps(summary))
EOF
tail -n 5 "$OUT/norm-rope-tests.txt"

timeout 60 python3 bench/kernels.py --ops rms_norm,rms_norm_q,rope_q --model-steps 0 \
  --out "$OUT/kernels-norm-rope-h200.json" > "$OUT/kernels-norm-rope.txt" 2>&1
echo "kernels rc=$?"; tail -n 32 "$OUT/kernels-norm-rope.txt" | cut -c1-200

timeout 200 python3 bench/graph_decode.py --requests 1,8 --profile --out "$OUT/graph-profile-norm-rope-h200.json" \
  > "$OUT/graph-profile-norm-rope.txt" 2>&1
echo "graph_decode rc=$?"
python3 - "$OUT" <<'EOF'
import json, sys
try:
    cells = json.load(open(f"{sys.argv[1]}/graph-profile-norm-rope-h200.json"))["cells"]
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"no graph profile: {e!r}")
for c in cells:
    p = c.get("profile", {})
    print({k: c.get(k) for k in ("requests", "graph_ms", "graph_max_abs_diff", "static_max_abs_diff")},
          {k: p.get(k) for k in ("launches_per_step", "kernel_us_per_step", "busy_fraction")})
EOF
