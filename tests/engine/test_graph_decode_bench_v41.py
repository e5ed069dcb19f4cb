"""bench/graph_decode.py with `--config tiny-v41` runs end to end on the CPU (`--smoke`: references, no
graph): the V4.1 static step (`StaticDecoderV41`) follows the dynamic path on fabricated states, here
with an image-token id set (`--image-token-id`, as the released checkpoint has one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_graph_decode_bench_smoke_v41(tmp_path):
    out = tmp_path / "graph-decode-v41.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(ROOT / "bench" / "graph_decode.py"), "--smoke", "--config", "tiny-v41",
                    "--image-token-id", "5", "--out", str(out)], check=True, env=env, cwd=ROOT, capture_output=True, timeout=120)
    r = json.loads(out.read_text())
    assert r["conditions"]["config"] == "tiny-v41" and r["conditions"]["engram_tables"] == "device"
    assert r["conditions"]["image_token_id"] == 5
    assert [c["requests"] for c in r["cells"]] == [1, 2]
    for c in r["cells"]:
        assert c["dynamic_ms"] > 0 and c["static_eager_ms"] > 0 and "graph_ms" not in c
        assert c["static_max_abs_diff"] < 1e-4
    assert r["roofline"]["state_bytes"] > 0 and set(r["batch1_pct_of_hbm_roofline"]) == {"dynamic", "static_eager"}
