"""bench/graph_decode.py runs end to end on the CPU (`--smoke`: tiny-v4, references, no graph), and its
static step follows the dynamic path on the fabricated states."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_graph_decode_bench_smoke(tmp_path):
    out = tmp_path / "graph-decode.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(ROOT / "bench" / "graph_decode.py"), "--smoke", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=120)
    r = json.loads(out.read_text())
    assert [c["requests"] for c in r["cells"]] == [1, 2]
    for c in r["cells"]:
        assert c["dynamic_ms"] > 0 and c["static_eager_ms"] > 0 and "graph_ms" not in c
        assert c["static_max_abs_diff"] < 1e-4
    assert r["roofline"]["roofline_s"] > 0 and set(r["batch1_pct_of_hbm_roofline"]) == {"dynamic", "static_eager"}


def test_graph_decode_bench_profile_reports_where_the_step_goes(tmp_path):
    """`--profile`: per cell, kernel (here: op) time per name, ops per step and `op_sites`, the torch
    ops of one step by the dspark function that dispatched them, summing to the total."""
    out = tmp_path / "graph-profile.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(ROOT / "bench" / "graph_decode.py"), "--smoke", "--requests", "1", "--profile",
                    "--out", str(out)], check=True, env=env, cwd=ROOT, capture_output=True, timeout=180)
    cell = json.loads(out.read_text())["cells"][0]
    profile, sites = cell["profile"], cell["op_sites"]
    assert profile["of"] == "static eager step" and profile["launches_per_step"] > 0 and profile["top"]
    assert sites["torch_ops_per_step"] >= sum(r["ops"] for r in sites["top"]) > 0
    assert any(r["site"].startswith("models/deepseek_v4/static_") for r in sites["top"])


def test_gemv_ab_takes_labels_and_captures_with_the_moe_gemv_kernels():
    """`--gemv-ab moe_up_gemv` picks one variant (an unknown label exits naming it), and `captured_with`
    swaps `moe_decode.UP_TMA` for the capture and puts it back after; `moe_down_gemv` the same with
    `DOWN_TMA`."""
    import pytest

    import graph_decode
    from dspark.kernels import moe_decode

    assert graph_decode._labels("moe_up_gemv") == ("moe_up_gemv",)
    assert set(graph_decode._labels(",".join(graph_decode.GEMV_VARIANTS))) == set(graph_decode.GEMV_VARIANTS)
    with pytest.raises(SystemExit, match="unknown \\['tma'\\]"):
        graph_decode._labels("cublas,tma")
    shipped = moe_decode.UP_TMA
    with graph_decode.captured_with(graph_decode.GEMV_VARIANTS["moe_up_gemv"]):
        assert moe_decode.UP_TMA is None and moe_decode.decode_tiles(1, 128).up_tma is None
    assert moe_decode.UP_TMA == shipped is not None
    shipped_down = moe_decode.DOWN_TMA
    assert moe_decode.decode_tiles(8, None).down_tma is not None
    with graph_decode.captured_with(graph_decode.GEMV_VARIANTS["moe_down_gemv"]):
        assert moe_decode.decode_tiles(8, None).down_tma is None and moe_decode.UP_TMA == shipped
    assert moe_decode.DOWN_TMA is shipped_down and moe_decode.decode_tiles(8, None).down_tma is not None


def test_moe_late_withholds_x_ready_while_captured(monkeypatch):
    """`--gemv-ab moe_late`: while captured, the decode MoE's experts get `x_ready` False whatever the layer
    promised, and the router's select kernel waits before it releases; after it, both as shipped."""
    import graph_decode
    from dspark.kernels import moe_decode, moe_route_decode

    seen = []
    monkeypatch.setattr(moe_decode, "decode_experts", lambda *a, x_ready=False, **kw: seen.append(x_ready))
    with graph_decode.captured_with(graph_decode.GEMV_VARIANTS["moe_late"]):
        moe_decode.decode_experts(1, x_ready=True)
        assert moe_route_decode.RELEASE_FIRST is False
    moe_decode.decode_experts(1, x_ready=True)
    assert seen == [False, True] and moe_route_decode.RELEASE_FIRST is True


def test_k_tile_2048_widens_the_gemv_tiles_while_captured():
    """`--gemv-ab k_tile_2048`: while captured, `linear.gemv_tiles` (and so `grouped_wo_a`'s GEMV, which
    imports it) gives rows of 2048 one 2048-wide K tile; after it, the shipped 1024-wide tiles."""
    import graph_decode
    from dspark.kernels import grouped_wo_a, linear

    shipped = linear.gemv_tiles(512, 2048, 132, 1)
    with graph_decode.captured_with(graph_decode.GEMV_VARIANTS["k_tile_2048"]):
        assert linear.GEMV_K_TILE == 2048
        assert grouped_wo_a.gemv_tiles(2048, 4096, 132, 1)[1] == linear.gemv_tiles(512, 2048, 132, 4)[1] == 2048
    assert linear.GEMV_K_TILE == 1024 and linear.gemv_tiles(512, 2048, 132, 1) == shipped and shipped[1] == 1024


def test_rope_epilogue_is_on_only_while_captured():
    import graph_decode
    from dspark.kernels import linear

    with graph_decode.captured_with(graph_decode.GEMV_VARIANTS["rope_epilogue"]):
        assert linear.ROPE_EPILOGUE is True
    assert linear.ROPE_EPILOGUE is False


def test_q_norm_fold_is_on_only_while_captured():
    import graph_decode
    from dspark.kernels import attention

    with graph_decode.captured_with(graph_decode.GEMV_VARIANTS["q_norm_fold"]):
        assert attention.Q_NORM_FOLD is True
    assert attention.Q_NORM_FOLD is False


def test_head_weights_early_is_on_only_while_captured():
    import graph_decode
    from dspark.models.deepseek_v4 import side_stream

    with graph_decode.captured_with(graph_decode.GEMV_VARIANTS["head_weights_early"]):
        assert side_stream.HEAD_WEIGHTS_EARLY is True
    assert side_stream.HEAD_WEIGHTS_EARLY is False
