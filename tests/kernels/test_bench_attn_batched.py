"""bench/attn_batched.py's attention + `wo_a` rows (`projected_rows`) on the CPU: a stand-in for
flashinfer's op (the reference softmax over the keys, then the sink pass or the deferred weights),
the Triton ops in the interpreter, a wall-clock timer for the graph one."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from dspark.kernels import attention_flashinfer, triton_available
from dspark.kernels.attention_ref import sparse_attention_lse_ref

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")


@pytest.fixture(scope="module")
def bench():
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # the script's own imports (bench.engine_h200, provenance)
    spec = importlib.util.spec_from_file_location("bench_attn_batched", ROOT / "bench" / "attn_batched.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
    del sys.path[:2]


class StandIn:
    """flashinfer's op as the bench drives it (`run`, `run_deferred`), from the reference math."""

    def __init__(self, index):
        self.index, self.lengths = index, (index >= 0).sum(dim=1, dtype=torch.int32)

    def kernel(self, q, pool):
        return sparse_attention_lse_ref(q, pool, self.index, q.shape[-1] ** -0.5)

    def run(self, q, pool, sink):
        return attention_flashinfer.apply_sink(*self.kernel(q, pool), sink, self.lengths)

    def run_deferred(self, q, pool, sink):
        out, lse = self.kernel(q, pool)
        return out, attention_flashinfer.sink_weights(lse, sink, self.lengths)


def test_projected_rows_time_both_ways_and_agree(bench, monkeypatch):
    monkeypatch.setattr(bench, "graph_timer", bench.cpu_timer)
    g = torch.Generator().manual_seed(0)
    q, pool, index, sink, _ = bench.decode_inputs(2, 4, 128, None, 1024, torch.device("cpu"), g)
    row = bench.projected_rows(StandIn(index), q, pool, sink, 10**6, torch.device("cpu"), copy_bps=1e12)
    assert row["deferred_equal"] is True  # the projection of the deferred weights = that of the sink pass
    for key in ("wo_a_graph_us", "project_graph_us", "deferred_graph_us", "sink_pass_pct_hbm", "deferred_pct_hbm",
                "sink_pass_pct_copy", "deferred_pct_copy"):
        assert row[key] > 0, key
