"""bench/route_decode.py: arguments, and the whole pipeline in --smoke mode (interpreter, tiny shapes)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from dspark.kernels import triton_available

BENCH = Path(__file__).resolve().parents[2] / "bench" / "route_decode.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_route_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_defaults_cover_both_layers_and_sizes(bench):
    args = bench.parse_args([])
    assert args.out == "bench/results/route-decode.json" and not args.smoke
    assert set(bench.LAYERS) == {"v4-mini", "v4-flash"} and bench.TOKENS == (1, 8, 64, 256, 4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
def test_refuses_to_time_without_gpu(bench, capsys):
    assert bench.main(["--out", "unused.json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available() or not triton_available(), reason="CPU smoke run (interpreter)")
def test_smoke_writes_every_path_and_sweep(bench, tmp_path):
    out = tmp_path / "route.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["M"] for r in result["results"]] == list(bench.SMOKE_TOKENS)
    for row in result["results"]:
        for path in ("ref", "prefill", "decode", "moe_route"):
            assert row[path]["vs_ref"]["same_experts"] == 1.0 and row[path]["vs_ref"]["max_abs_w_diff"] < 1e-5
            assert row[path]["warm_us"] > 0
    assert len(result["sweep"]) == len(bench.SMOKE_SWEEP) * len(bench.SMOKE_TOKENS)
    assert set(result["best_tiles"]) == {f"tiny M={m}" for m in bench.SMOKE_TOKENS}
