"""bench/graph_draft.py runs end to end on the CPU (`--smoke`: tiny-v4, references, no graph), and its
static drafts equal the dynamic drafter's on the fabricated states."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("n_draft", [None, 2])
def test_graph_draft_bench_smoke(tmp_path, n_draft):
    out = tmp_path / "graph-draft.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    trim = [] if n_draft is None else ["--n-draft", str(n_draft)]
    subprocess.run([sys.executable, str(ROOT / "bench" / "graph_draft.py"), "--smoke", "--out", str(out), *trim],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=120)
    r = json.loads(out.read_text())
    assert [c["requests"] for c in r["cells"]] == [1, 2] and r["conditions"]["gamma"] == 5
    assert all(c["n_draft"] == (n_draft or 5) for c in r["cells"])
    for c in r["cells"]:
        for key in ("dynamic", "static_eager", "dynamic_sampled", "static_sampled_eager", "observe_dynamic",
                    "observe_static_eager"):
            assert c[f"{key}_ms"] > 0
        assert "graph_ms" not in c and "observe_graph_ms" not in c
        assert c["static_token_mismatches"] == 0 and c["static_conf_logit_max_abs_diff"] < 1e-4
