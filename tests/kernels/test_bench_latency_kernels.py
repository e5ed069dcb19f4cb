"""bench/latency_kernels.py --smoke: every former / new launch pair runs through the interpreter on tiny
shapes, and the script's checks hold (RoPE and top-k bit for bit, attention within tolerance)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dspark.kernels import triton_available


@pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the bench's --smoke runs the CPU interpreter")
def test_latency_kernels_bench_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_latency_kernels", Path(__file__).resolve().parents[2] / "bench" / "latency_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "latency.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["op"] for r in rows] == ["rope", "select_topk", "select_topk", "sparse_attention", "sparse_attention"]
    assert all("error" not in r and {"former", "new"} <= r["us"].keys() for r in rows)
    for row in rows:
        if row["op"] == "sparse_attention":
            assert row["op_is_new"] and max(row["rel_err_ref"].values()) < 1e-5
        else:
            assert all(row["equal_ref"].values())
    assert rows[3]["case"] == "csa_keys128" and rows[3]["max_abs_former_new"] < 1e-5  # two key chunks merged


@pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the bench's --smoke runs the CPU interpreter")
def test_select_round_sweep_smoke(tmp_path):
    """bench/select_round_sweep.py --smoke: every warps / rows variant, and the former kernels loaded
    from files (here the shipped ones), equal the references bit for bit."""
    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_select_round_sweep", repo / "bench" / "select_round_sweep.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "sweep.json"
    kernels = repo / "dspark" / "kernels"
    assert bench.main(["--smoke", "--out", str(out), "--former-round", str(kernels / "cache_round.py"),
                       "--former-select", str(kernels / "indexer.py")]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["op"] for r in rows] == ["select_topk"] * 2 + ["cache_round"] * 2
    assert all("former" in r["us"] and all(r["equal_ref"].values()) and not r.get("errors") for r in rows)
