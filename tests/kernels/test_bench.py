"""bench/kernels.py must import, parse its arguments and plan its cases on a machine without a GPU."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from dspark.kernels import triton_available

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_default_plan_covers_every_op_layer_and_size(bench):
    args = bench.parse_args([])
    assert args.out == "bench/results/kernels.json"
    cases = bench.plan(args)
    # fused_moe_packed only where M·K <= 64 (M = 1, 8); the indexer ops at decode sizes (M <= 256)
    assert len(cases) == 2 * (len(bench.OPS) * 5 - 3 - len(bench.DECODE_ONLY))
    assert {m for _, _, m in cases} == {1, 8, 64, 256, 4096}
    assert {s.name for s, _, _ in cases} == {"v4-flash", "v4-mini"}


def test_options_select_and_scale(bench):
    args = bench.parse_args(["--configs", "flash", "--ops", "mhc_pre,fused_moe", "--tokens", "1,64",
                             "--flash-experts", "64", "--out", "x.json"])
    cases = bench.plan(args)
    assert [(s.n_experts, op, m) for s, op, m in cases] == [
        (64, "mhc_pre", 1), (64, "mhc_pre", 64), (64, "fused_moe", 1), (64, "fused_moe", 64)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--ops", "attention"])


def test_dry_run_lists_cases_without_gpu(bench, capsys):
    assert bench.main(["--dry-run", "--configs", "mini", "--ops", "mhc_post"]) == 0
    assert capsys.readouterr().out.count("mhc_post") == 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
def test_refuses_to_time_without_gpu(bench, capsys):
    assert bench.main(["--configs", "mini", "--tokens", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
@pytest.mark.parametrize("op", ["mhc_post_pre", "mhc_v41_post_pre", "fused_moe_fp8_32", "fused_moe_packed",
                                "attn_csa", "indexer_v41", "indexer_pool", "compressor_hca", "grouped_wo_a",
                                "linear_wkv", "compressor_project", "index_scores"])
def test_case_pipeline_on_a_tiny_layer(bench, op, monkeypatch):
    """Inputs, checks and floor accounting of a case, on a tiny layer (interpreter on CPU)."""
    if op.startswith("indexer") or op == "index_scores":
        monkeypatch.setattr(bench, "CONTEXT", 4096)  # the interpreter scores every entry: 32K is slow
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = bench.LayerShape("tiny", dim=64, n_hc=4, n_experts=4, top_k=2, inter=64, n_heads=2, head_dim=32,
                              o_groups=2, o_rank=16, rope_dim=8)
    layer = bench.build_layer(shape, device)
    row = bench.run_case(shape, op, 3, layer, timer=lambda fn: 1e-3, ref_timer=lambda fn: 1e-3, device=device)
    assert row["rel_err"] < 1e-2 and row["speedup"] == 1.0
    if op == "mhc_post_pre":  # x read + X' written (3·4·64 bf16 each), f read + u written, fn fp32
        assert row["bytes"] == 2 * 3 * 4 * 64 * 2 + 2 * 3 * 64 * 2 + 24 * 256 * 4
    elif op == "mhc_v41_post_pre":  # + f, post, comb, carried pre, norm weight in; pre/post/comb, h out
        streams, one_row = 3 * 4 * 64 * 2, 3 * 64 * 2
        assert row["bytes"] == (2 * streams + 2 * one_row + 24 * 256 * 4 + 3 * 4 * 4 + 64 * 4 + 3 * 24 * 4
                                + 3 * 20 * 4)
        assert row["flop"] == 2 * 3 * 24 * 256 + 2 * 3 * 16 * 64
    elif op == "indexer_pool":  # 3 rows of 4K fp32 scores read, the bool mask written
        assert row["bytes"] == 3 * 4096 * 5 + 3 * 8 and row["rel_err"] == 0.0
    elif op == "attn_csa":  # 3 queries x 2 heads over window 128 + top-512, QK and PV
        assert row["flop"] == 4 * 3 * 2 * (128 + 512) * 32
    elif op == "indexer_v41":  # 3 rows x 32 heads x 4K entries x di 128; scores written, pool read
        assert row["flop"] == 2 * 3 * 32 * 4096 * 128
        assert row["bytes"] == (4096 + 3 * 32) * 128 * 2 + 3 * 32 * 4 + 3 * 4096 * (4 + 1) + 3 * 512 * 8
    elif op == "compressor_hca":  # 3 entries x 128 rows x d 32: bf16 values + fp32 logits, entries out
        assert row["bytes"] == 3 * 128 * 32 * (2 + 4) + 32 * 4 + 3 * 32 * 2
    elif op == "grouped_wo_a":  # wo_a [2·16, 32], out [3, 2, 32] and cos/sin [3, 4] in, [3, 32] out
        assert row["bytes"] == 32 * 32 * 2 + 3 * 2 * 32 * 2 + 2 * 3 * 4 * 4 + 3 * 32 * 2
        assert row["flop"] == 2 * 3 * 32 * 32
    elif op == "linear_wkv":  # wkv [32, 64], x [3, 64] in, [3, 32] out
        assert row["bytes"] == 32 * 64 * 2 + 3 * 64 * 2 + 3 * 32 * 2 and row["flop"] == 2 * 3 * 32 * 64
    elif op == "compressor_project":  # wkv, wgate [64, 64], x, ape [4, 64] in; kv bf16 + score fp32 out
        assert row["bytes"] == 2 * 64 * 64 * 2 + 3 * 64 * 2 + 3 * 64 * 6 + 4 * 64 * 4
        assert row["flop"] == 4 * 3 * 64 * 64
    elif op == "index_scores":  # 3 slots x 1K keys (4K context / 4) x 64 heads x di 128, scores out
        assert row["bytes"] == (3 * 1024 + 3 * 64) * 128 * 2 + 3 * 64 * 4 + 3 * 1024 * 4
        assert row["flop"] == 2 * 3 * 64 * 1024 * 128
    else:
        assert row["flop"] == 2 * 3 * 4 * 64 + 2 * 3 * 3 * 3 * 64 * 64


def test_graph_timings_flush_by_a_read_unless_asked(bench):
    """`--graph` times after `graph_timer`'s read flush by default (the write flush left dirty L2 lines that
    the op wrote back); `--flush write` keeps the older timing; anything else is refused by name."""
    assert bench.parse_args([]).flush == "read"
    assert bench.parse_args(["--graph", "--flush", "write"]).flush == "write"
    with pytest.raises(SystemExit):
        bench.parse_args(["--flush", "evict"])
