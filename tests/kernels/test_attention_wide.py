"""`attention_wide._wide_kernel` (Tiles(wide=True)): every launch shape computes `sparse_attention_ref`.

Inputs as in test_sparse_attention.py (window with −1 before position 0, CSA picks with −1 holes),
random, outputs poisoned; several head blocks (40 heads in blocks of 16) or every head in one
program, one value half or two, one key chunk (the kernel writes the output) or several (partials
merged by `_combine_kernel`).
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from dspark.kernels import attention, triton_available
from test_sparse_attention import TOL, make_inputs, rel_err

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")

WIDE = [
    attention.Tiles(64, 16, 4, wide=True),  # every head in one program, whole value rows
    attention.Tiles(64, 16, 4, wide=True, value_split=2),  # every head, two programs per query share d
    attention.Tiles(16, 32, 4, wide=True, value_split=2, waves=8),  # 3 head blocks x 2 halves, several chunks
    attention.Tiles(16, 16, 4, wide=True, waves=16, min_chunk_tiles=1),  # many one-tile chunks
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", WIDE, ids=lambda t: f"h{t.block_h}n{t.block_n}v{t.value_split}w{t.waves}")
@pytest.mark.parametrize("n_q,n_heads,head_dim,top_k", [(5, 40, 32, 20), (1, 3, 48, 0)])
def test_wide_tiles_match_ref(tiles, n_q, n_heads, head_dim, top_k, dtype, poisoned):
    """Verify rows over window + CSA picks (40 heads, d 32), and one decode row with H, d off the
    tiles (3 heads, d 48: masked heads and value columns)."""
    args = make_inputs(n_q, n_heads, head_dim, 30, 16, 40 if top_k else 0, top_k, dtype, seed=n_q + n_heads)
    with poisoned():
        out = attention.launch_sparse_attention(*args, 0.3, tiles)
    assert out.dtype == dtype
    assert rel_err(out, attention.sparse_attention_ref(*args, 0.3)) < TOL[dtype]


class CountLaunches:
    """Stands in for a kernel: counts its launches, then runs it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="counts chunks for the interpreter's 2-SM grid target")
@pytest.mark.parametrize("n_q,merged", [(8, False), (1, True)])
def test_one_chunk_writes_the_output_directly(n_q, merged, monkeypatch, poisoned):
    """With one key chunk (8 queries fill the interpreter's 2-SM grid target) the wide kernel applies
    the sink and writes `out` itself, no merge launch; one query splits its keys into chunks that
    `_combine_kernel` merges. Both equal the reference, the sink included."""
    combine = CountLaunches(attention._combine_kernel)
    monkeypatch.setattr(attention, "_combine_kernel", combine)
    q, pool, index, sink = make_inputs(n_q, 4, 32, 70, 16, 30, 12, torch.float32, seed=3)
    sink = sink + 2.0  # a sink that takes a visible share of the mass
    with poisoned():
        out = attention.launch_sparse_attention(q, pool, index, sink, 0.3,
                                                attention.Tiles(16, 16, 4, wide=True, min_chunk_tiles=1))
    assert combine.launches == int(merged)
    assert rel_err(out, attention.sparse_attention_ref(q, pool, index, sink, 0.3)) < TOL[torch.float32]


@needs_triton
def test_wide_row_without_keys_is_zero():
    q, pool, index, sink = make_inputs(2, 4, 32, 10, 8, 0, 0, torch.float32, seed=1)
    index[0] = -1
    out = attention.launch_sparse_attention(q, pool, index, sink, 0.2, attention.Tiles(16, 16, 4, wide=True))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out[1:], attention.sparse_attention_ref(q, pool, index, sink, 0.2)[1:]) < 1e-4


@pytest.mark.parametrize("bad", [dict(block_h=24), dict(block_n=8), dict(value_split=3),
                                 dict(value_split=2, wide=False), dict(num_stages=0)])
def test_tiles_reject_bad_launch_shapes(bad):
    fields = dict(block_h=16, block_n=16, num_warps=4, wide=True) | bad
    with pytest.raises(ValueError, match=next(iter(bad)) if "wide" not in bad else "value_split"):
        attention.Tiles(**fields)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the bench's --smoke runs the CPU interpreter")
def test_variants_bench_smoke(tmp_path):
    """bench/attn_variants.py --smoke: tiny shapes through the interpreter, every variant checked."""
    spec = importlib.util.spec_from_file_location(
        "bench_attn_variants", Path(__file__).resolve().parents[2] / "bench" / "attn_variants.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "v.json"
    assert bench.main(["--smoke", "--batches", "2", "--variants", "current,all_s4,all_v2_s4",
                       "--out", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 3 * 3 and all("error" not in r for r in rows)
    assert all(r["rel_err_ref"] < 2e-2 and r["rel_err_current"] < 2e-2 for r in rows)


@needs_triton
@pytest.mark.parametrize("n_q,wide", [(64, True), (8, False)])
def test_sparse_attention_runs_wide_from_64_queries(n_q, wide, monkeypatch):
    """The op picks `attention_wide` (with `wide_tiles`) for 64+ query rows at head_dim 512, as
    measured on the H200, and the shipped kernel below; both equal the reference."""
    from dspark.kernels import attention_wide

    kernel = CountLaunches(attention_wide._wide_kernel)
    monkeypatch.setattr(attention_wide, "_wide_kernel", kernel)
    q, pool, index, sink = make_inputs(n_q, 2, 512, 12, 8, 0, 0, torch.float32, seed=n_q)
    out = attention.sparse_attention(q, pool, index, sink, 0.05)
    assert kernel.launches == int(wide)
    assert rel_err(out, attention.sparse_attention_ref(q, pool, index, sink, 0.05)) < TOL[torch.float32]
    assert attention.wide_tiles(32) == attention.Tiles(32, 32, 8, num_stages=4, waves=1, wide=True)
