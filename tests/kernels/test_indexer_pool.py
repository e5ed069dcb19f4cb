"""V4.1 candidate pool (dspark/kernels/indexer_pool.py): fused Triton vs torch reference, and the
reference vs spec §5.4. On CPU the kernels run under the interpreter (conftest.py)."""

import pytest
import torch
import torch.nn.functional as F

from dspark.kernels import indexer_pool, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INF = float("inf")


def masked_scores(n_q: int, n_keys: int, seed: int, ties: bool = False):
    """Index scores [S, T] masked as the candidate source's are (−inf at t >= visible), and visible
    [S] spanning nothing visible .. everything visible. With `ties`, scores are rounded to a few
    levels (ReLU zeros and equal block maxima are common in real rows)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n_q, n_keys, generator=g)
    if ties:
        scores = scores.clamp(min=0).mul(2).round()
    visible = torch.randint(0, n_keys + 1, (n_q,), generator=g)
    visible[0], visible[-1] = 0, n_keys
    scores = scores.masked_fill(torch.arange(n_keys) >= visible[:, None], -INF)
    return scores.to(DEVICE), visible.to(DEVICE)


def topk_pool(scores, visible, topk_blocks, block):
    """Spec §5.4 written with torch.topk (no tie rule), for rows without tied block scores."""
    width = scores.shape[-1]
    blocks = F.pad(scores, (0, -width % block), value=-INF).unflatten(-1, (-1, block)).amax(-1)
    ids = torch.arange(blocks.shape[-1], device=scores.device)
    blocks = blocks.masked_fill(ids == ((visible - 1) // block)[:, None], INF)
    top = blocks.topk(min(topk_blocks, blocks.shape[-1]), dim=-1)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > -INF)
    return keep.repeat_interleave(block, dim=-1)[:, :width]


# ---------------------------------------------------------------------------------- reference


def test_ref_is_the_spec_pool_without_ties():
    scores, visible = masked_scores(9, 37, seed=0)
    for topk_blocks, block in ((3, 4), (2, 8), (20, 4), (1, 5)):
        keep = indexer_pool.indexer_pool_ref(scores, visible, topk_blocks=topk_blocks, block=block)
        assert torch.equal(keep, topk_pool(scores, visible, topk_blocks, block))


def test_ref_ties_keep_the_lower_block_and_pin_the_newest():
    scores = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.5, -INF]])  # blocks of 2: 1, 1, 1, 0.5 (newest)
    keep = indexer_pool.indexer_pool_ref(scores, torch.tensor([7]), topk_blocks=2, block=2)
    assert keep[0].tolist() == [True, True, False, False, False, False, True, True]
    keep = indexer_pool.indexer_pool_ref(scores, torch.tensor([5]), topk_blocks=1, block=2)
    assert keep[0].tolist() == [False] * 4 + [True, True, False, False]  # the pin beats the tie rule
    keep = indexer_pool.indexer_pool_ref(torch.full((1, 6), -INF), torch.tensor([0]), topk_blocks=3, block=2)
    assert not keep.any()  # nothing visible: nothing pinned, no block above −inf


@pytest.mark.parametrize("bad", ["scores", "visible", "topk_blocks", "block"])
def test_rejects_bad_arguments(bad):
    args = dict(scores=torch.randn(2, 8), visible=torch.tensor([3, 8]), topk_blocks=2, block=4)
    args[bad] = {"scores": torch.randn(2, 8).double(), "visible": torch.tensor([3.0, 8.0]),
                 "topk_blocks": 0, "block": True}[bad]
    with pytest.raises(ValueError, match=bad):
        indexer_pool.indexer_pool_ref(args["scores"], args["visible"], topk_blocks=args["topk_blocks"],
                                      block=args["block"])


# ------------------------------------------------------------------------------- fused vs reference


@needs_triton
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("n_q,n_keys,topk_blocks,block", [(1, 5, 2, 4), (6, 37, 3, 4), (5, 100, 4, 8),
                                                          (4, 50, 6, 3), (3, 64, 100, 8)])
def test_fused_matches_ref(n_q, n_keys, topk_blocks, block, ties, poisoned):
    scores, visible = masked_scores(n_q, n_keys, seed=n_keys, ties=ties)
    with poisoned():
        keep = indexer_pool.indexer_pool(scores, visible, topk_blocks=topk_blocks, block=block)
    assert keep.dtype == torch.bool and keep.shape == scores.shape
    assert torch.equal(keep, indexer_pool.indexer_pool_ref(scores, visible, topk_blocks=topk_blocks, block=block))


@needs_triton
def test_fused_streamed_rows_match_ref(monkeypatch, poisoned):
    """Rows of more blocks than stay in registers (the limit lowered to reach the streamed path)."""
    monkeypatch.setattr(indexer_pool, "_REGISTER_ROW", 16)
    monkeypatch.setattr(indexer_pool, "_STREAM_TILE", 16)
    scores, visible = masked_scores(3, 150, seed=4, ties=True)
    with poisoned():
        keep = indexer_pool.indexer_pool(scores, visible, topk_blocks=5, block=4)
    assert torch.equal(keep, indexer_pool.indexer_pool_ref(scores, visible, topk_blocks=5, block=4))


# ----------------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("n_q", [1, 8, 64])
@pytest.mark.parametrize("n_keys", [20_000, 131_072])  # beyond the 16 384-entry pool; the second streams
def test_real_shapes_on_gpu(n_q, n_keys):
    scores, visible = masked_scores(n_q, n_keys, seed=n_q, ties=True)
    keep = indexer_pool.indexer_pool(scores, visible, topk_blocks=2048, block=8)
    assert torch.equal(keep, indexer_pool.indexer_pool_ref(scores, visible, topk_blocks=2048, block=8))
