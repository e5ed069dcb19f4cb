"""Sparse MQA with sink (dspark/kernels/attention.py): fused Triton vs the torch reference.

Index lists are built as the model builds them: the sliding window (−1 before position 0) followed
by compressed entries (HCA: every visible one; CSA: a top-k subset with −1 holes), so one test
covers decode (S = 1), verify blocks (a few rows) and prefill rows; chunking of the keys across
programs is exercised by key lists longer than one chunk.
"""

import pytest
import torch

from dspark.kernels import attention, attention_ref, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    assert not out.isnan().any(), "NaN in output: an element was not written"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_inputs(n_q, n_heads, head_dim, start, window, n_entries, top_k, dtype, seed):
    """q [S, H, d], pool [window rows + entries, d], index [S, W (+ top_k)], sink [H]; random, no zeros.

    Queries sit at positions start .. start+S−1; pool row r holds position r (window part), then
    the compressed entries. CSA-like picks (top_k > 0) are random entries with some −1 holes."""
    g = torch.Generator().manual_seed(seed)
    n_raw = start + n_q
    pool = torch.randn(n_raw + n_entries, head_dim, generator=g)
    q = torch.randn(n_q, n_heads, head_dim, generator=g)
    sink = torch.randn(n_heads, generator=g) * 0.5 + 0.5
    positions = torch.arange(start, start + n_q)
    keys = positions[:, None] - (window - 1) + torch.arange(window)
    index = torch.where(keys >= 0, keys, -1)
    if n_entries:
        if top_k:
            picks = torch.stack([torch.randperm(n_entries, generator=g)[:top_k] for _ in range(n_q)]) + n_raw
            picks[torch.rand(n_q, top_k, generator=g) < 0.2] = -1
        else:  # HCA: every entry w < (p + 1) // 4 is visible
            w = torch.arange(n_entries)
            picks = torch.where(w[None, :] < ((positions + 1) // 4)[:, None], w + n_raw, -1)
        index = torch.cat((index, picks), dim=1)
    return (q.to(DEVICE, dtype), pool.to(DEVICE, dtype), index.to(DEVICE), sink.to(DEVICE))


CASES = [  # (S, H, d, first position, window, compressed entries, top-k)
    (1, 4, 32, 0, 8, 0, 0),  # first decode token: one key, the rest −1
    (1, 3, 48, 40, 16, 0, 0),  # decode with a full window; H, d off the tiles
    (4, 4, 32, 37, 16, 9, 0),  # verify block, HCA entries
    (3, 16, 64, 70, 16, 30, 12),  # verify block, CSA top-k with holes
    (20, 2, 32, 5, 8, 0, 0),  # prefill rows, window only
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_q,n_heads,head_dim,start,window,n_entries,top_k", CASES)
def test_sparse_attention_matches_ref(n_q, n_heads, head_dim, start, window, n_entries, top_k, dtype, poisoned):
    args = make_inputs(n_q, n_heads, head_dim, start, window, n_entries, top_k, dtype, seed=n_q + head_dim)
    scale = head_dim ** -0.5
    with poisoned():
        out = attention.sparse_attention(*args, scale)
    ref = attention.sparse_attention_ref(*args, scale)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


@needs_triton
@pytest.mark.parametrize("tiles", [
    attention.Tiles(16, 16, 4, heads_fastest=True, waves=8),  # 3 head blocks of one query back to back
    attention.Tiles(16, 32, 4, heads_fastest=False, waves=1),  # query rows of one head block back to back
    attention.Tiles(16, 16, 4, waves=8, prefetch=True),  # next key tile gathered ahead
])
def test_launch_tiles_match_ref(tiles, poisoned):
    """Every launch shape the bench sweeps computes the same op: several head blocks (40 heads in
    blocks of 16) and key chunks, both program orders."""
    args = make_inputs(5, 40, 32, 30, 16, 40, 20, torch.float32, seed=5)
    with poisoned():
        out = attention.launch_sparse_attention(*args, 0.3, tiles)
    assert rel_err(out, attention.sparse_attention_ref(*args, 0.3)) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("combine_chunks", [1, 4, 16])
def test_chunks_merged_per_step_match_ref(combine_chunks, poisoned):
    """One decode query over 7 key chunks of 3 head blocks (40 heads): the merge takes 1, 4 (a
    masked tail of 1) or 8 chunks per step, in 1, 2 or 4 d-blocks; each equals the reference, the
    sink included, and the merges differ only by the fp32 order of their sums."""
    args = make_inputs(1, 40, 128, 180, 64, 300, 140, torch.float32, seed=7)
    tiles = attention.Tiles(16, 16, 4, waves=16, min_chunk_tiles=1, combine_chunks=combine_chunks)
    with poisoned():
        out = attention.launch_sparse_attention(*args, 0.3, tiles)
    assert rel_err(out, attention.sparse_attention_ref(*args, 0.3)) < TOL[torch.float32]
    former = attention.launch_sparse_attention(*args, 0.3, attention.Tiles(16, 16, 4, waves=16, min_chunk_tiles=1,
                                                                           combine_chunks=1))
    assert rel_err(out, former) < 1e-6


def test_combine_blocks_spread_one_decode_query():
    """v4-mini's CSA decode merge (10 chunks, 2 head blocks of 16, d 512): 16 chunks x 16 columns
    per program, 64 programs; one chunk per step keeps the former [16, 128] tiles; 64-head blocks
    merge 4 chunks at a time."""
    assert attention.combine_blocks(10, 16, 512, 16) == (16, 16)
    assert attention.combine_blocks(10, 16, 512, 1) == (1, 128)
    assert attention.combine_blocks(3, 16, 512, 16) == (4, 64)
    assert attention.combine_blocks(10, 64, 512, 16) == (4, 16)
    assert attention.combine_blocks(10, 64, 512, 1) == (1, 128)
    with pytest.raises(ValueError, match="combine_chunks must be a power of two >= 1, got 3"):
        attention.Tiles(16, 16, 4, combine_chunks=3)


@needs_triton
def test_sparse_attention_sink_and_empty_rows():
    """A row with no key returns 0 (all mass on the sink); a large sink shrinks the output."""
    q, pool, index, sink = make_inputs(2, 4, 32, 10, 8, 0, 0, torch.float32, seed=1)
    index[0] = -1
    out = attention.sparse_attention(q, pool, index, sink, 0.2)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    big = attention.sparse_attention(q, pool, index, sink + 30.0, 0.2)
    assert big[1].abs().max() < 1e-6 * out[1].abs().max() + 1e-9
    assert rel_err(out, attention.sparse_attention_ref(q, pool, index, sink, 0.2)) < 1e-4


def test_model_uses_the_kernel_reference():
    """The model's attention core is the op's reference (one definition)."""
    from dspark.models.deepseek_v4 import attention as model_attention

    assert model_attention.sparse_attention is attention_ref.sparse_attention_ref


def test_sparse_attention_rejects_bad_arguments():
    q, pool, index, sink = make_inputs(2, 4, 32, 10, 8, 0, 0, torch.float32, seed=1)
    with pytest.raises(ValueError, match="pool"):
        attention_ref.sparse_attention_ref(q, pool[:, :16], index, sink, 0.2)
    with pytest.raises(ValueError, match="index"):
        attention_ref.sparse_attention_ref(q, pool, index.float(), sink, 0.2)
    with pytest.raises(ValueError, match="sink"):
        attention_ref.sparse_attention_ref(q, pool, index, sink[:2], 0.2)


@pytest.mark.gpu
@pytest.mark.parametrize("n_q", [1, 4, 512])
@pytest.mark.parametrize("n_entries,top_k", [(256, 0), (8192, 512)])
def test_flash_shapes_on_gpu(n_q, n_entries, top_k):
    """V4-Flash attention at 32K context: 64 heads, d 512, window 128, HCA (256 entries) or CSA
    (top-512 of 8192 entries), bf16."""
    args = make_inputs(n_q, 64, 512, 32768 - n_q, 128, n_entries, top_k, torch.bfloat16, seed=n_q)
    out = attention.sparse_attention(*args, 512 ** -0.5)
    assert rel_err(out, attention.sparse_attention_ref(*args, 512 ** -0.5)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads", [32, 64])
def test_batched_decode_on_gpu(n_heads):
    """128 requests decoding at 32K in one launch, each over its own window + top-512 CSA entries."""
    g = torch.Generator().manual_seed(0)
    n_req, rows = 128, 128 + 8192
    pool = torch.randn(n_req * rows, 512, generator=g).bfloat16().cuda()
    base = torch.arange(n_req).unsqueeze(-1) * rows
    picks = torch.rand(n_req, 8192, generator=g).argsort(-1)[:, :512].sort(-1).values
    index = torch.cat((base + torch.arange(128), base + 128 + picks), dim=-1).cuda()
    q = torch.randn(n_req, n_heads, 512, generator=g).bfloat16().cuda()
    sink = torch.randn(n_heads, generator=g).cuda()
    out = attention.sparse_attention(q, pool, index, sink, 512 ** -0.5)
    assert rel_err(out, attention.sparse_attention_ref(q, pool, index, sink, 512 ** -0.5)) < TOL[torch.bfloat16]
