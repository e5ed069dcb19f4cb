"""Block pooling folded into the indexer's scores (`indexer_pool.index_scores_pooled`, the POOL_B
epilogue of `indexer._score_kernel`): the fused op's scores are `index_scores`' and its block scores
are `indexer_pool`'s own, so the pool from them is the unfused pool bit for bit. On CPU the kernels
run under the interpreter (conftest.py).

Inputs are small integers with power-of-two head weights: every score is exact in each implementation
(so reference and kernel agree bit for bit too), with many tied scores and block maxima, ReLU zeros,
and −inf wherever an entry is not visible yet (rows from nothing visible to everything visible)."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig, indexer, indexer_pool, triton_available
from dspark.models.deepseek_v41.csa2 import Indexer
from dspark.models.deepseek_v41.static_step import StaticDecoderV41

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from static_step_checks import run_rounds  # noqa: E402

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(n_groups, n_q, n_heads, head_dim, n_keys, seed):
    """q [B, S, Hi, di], weights [B, S, Hi], keys [B, T, di], visible [B, S] (0 and T included)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (n_groups, n_q, n_heads, head_dim), generator=g).float()
    keys = torch.randint(-1, 2, (n_groups, n_keys, head_dim), generator=g).float()
    weights = 2.0 ** torch.randint(-2, 2, (n_groups, n_q, n_heads), generator=g).float()
    weights[..., 0] = -weights[..., 0]  # negative head weights occur: negative scores, −0 sums
    visible = torch.randint(0, n_keys + 1, (n_groups, n_q), generator=g)
    visible[0, 0], visible[-1, -1] = 0, n_keys
    return [t.to(DEVICE) for t in (q, weights, keys, visible)]


def unfused_pool(pool_op, scores, visible, topk_blocks, block):
    return pool_op(scores.flatten(0, 1), visible.flatten(), topk_blocks=topk_blocks, block=block)


def test_ref_matches_the_unfused_references():
    q, weights, keys, visible = make_inputs(2, 3, 4, 16, 37, seed=0)
    scores, bscores = indexer_pool.index_scores_pooled_ref(q, weights, keys, visible, block=4)
    assert torch.equal(scores, indexer.index_scores_ref(q, weights, keys, visible))
    assert bscores.shape == (2, 3, 10) and bscores.dtype == torch.float32
    flat = scores.flatten(0, 1), visible.flatten()
    assert torch.equal(bscores.flatten(0, 1), indexer_pool._block_scores_ref(*flat, 4))
    keep = indexer_pool.indexer_pool_ref(*flat, topk_blocks=3, block=4, bscores=bscores.flatten(0, 1))
    assert torch.equal(keep, indexer_pool.indexer_pool_ref(*flat, topk_blocks=3, block=4))


def test_pool_uses_the_given_block_scores():
    """bscores is used as given: block scores that disagree with `scores` change the pool."""
    scores, visible = torch.zeros(1, 8), torch.tensor([2])
    given = torch.tensor([[-float("inf"), 0.0, 5.0, 1.0]])  # not what the scores give
    keep = indexer_pool.indexer_pool_ref(scores, visible, topk_blocks=2, block=2, bscores=given)
    assert keep[0].tolist() == [False] * 4 + [True] * 4


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_rejects_bad_block_scores(bad):
    bscores = torch.zeros(2, 3) if bad == "shape" else torch.zeros(2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="bscores"):
        indexer_pool.indexer_pool_ref(torch.zeros(2, 8), torch.tensor([3, 8]), topk_blocks=1, block=4, bscores=bscores)


def test_rejects_a_bad_block():
    args = make_inputs(1, 1, 4, 16, 8, seed=0)
    with pytest.raises(ValueError, match="block"):
        indexer_pool.index_scores_pooled_ref(*args, block=0)


@needs_triton
@pytest.mark.parametrize("n_groups,n_q,n_heads,head_dim,n_keys,block,topk_blocks", [
    (2, 3, 4, 16, 37, 8, 2),  # BLOCK_T 64: 8 blocks a tile; T off the tile and the block
    (1, 9, 4, 16, 130, 4, 5),  # several row blocks (BLOCK_S 8) and key tiles
    (2, 2, 32, 512, 70, 8, 3),  # BLOCK_T 32 (wide heads): 4 blocks a tile
    (1, 2, 4, 16, 40, 1, 7),  # one entry a block
    (2, 3, 4, 16, 50, 3, 4),  # not a power of two: the scores, then `_block_max_kernel`
    (1, 2, 4, 16, 300, 128, 1),  # wider than the key tile: the same fallback
])
def test_fused_pool_is_the_unfused_pool(n_groups, n_q, n_heads, head_dim, n_keys, block, topk_blocks, poisoned,
                                        monkeypatch):
    args = make_inputs(n_groups, n_q, n_heads, head_dim, n_keys, seed=n_keys)
    passes = []  # `_block_max_kernel` launches of the fused op
    launch = indexer_pool._launch_block_max
    monkeypatch.setattr(indexer_pool, "_launch_block_max", lambda *a: passes.append(a) or launch(*a))
    with poisoned():
        scores, bscores = indexer_pool.index_scores_pooled(*args, block=block)
        assert len(passes) == (0 if block in (1, 4, 8) else 1)  # folded into the score kernel where tiles fit
        unfused_scores = indexer.index_scores(*args)
        want = unfused_pool(indexer_pool.indexer_pool, unfused_scores, args[3], topk_blocks, block)
        keep = unfused_pool(indexer_pool.indexer_pool, scores, args[3], topk_blocks, block)
        fused = indexer_pool.indexer_pool(scores.flatten(0, 1), args[3].flatten(), topk_blocks=topk_blocks,
                                          block=block, bscores=bscores.flatten(0, 1))
    assert torch.equal(scores, unfused_scores)  # the same scores, bit for bit
    assert torch.equal(keep, want)
    assert torch.equal(fused, want)  # the pool from the epilogue's block scores: the unfused pool
    ref_scores, ref_bscores = indexer_pool.index_scores_pooled_ref(*args, block=block)
    assert torch.equal(scores, ref_scores) and torch.equal(bscores, ref_bscores)  # exact integer scores
    assert bscores.isinf().any() and (bscores == float("inf")).any()  # masked blocks and pins exercised


# ------------------------------------------------------------------------------- the V4.1 call sites

V41_OPS = ("index_scores", "indexer_pool", "select_topk", "compressor_pool_gather", "compressor_project", "norm_rope")


def _v41_model(pooled: bool):
    """tiny-v41 (candidate source at layer 4, blocks of 4, 2 kept) with its static-step ops on Triton;
    `pooled`: `index_scores_pooled` too. Returns (model, the calls of the candidate source's pooled op)."""
    kernels = dataclasses.replace(KernelConfig.for_device(DEVICE), **{op: "triton" for op in V41_OPS},
                                  index_scores_pooled="triton" if pooled else "ref")
    model = dspark.init_model("tiny-v41", seed=0, device=DEVICE, dtype=torch.float32, kernels=kernels,
                              prefill_mode="exact", cache_qat=False)
    indexers = [m for m in model.modules() if isinstance(m, Indexer)]
    assert [i.pooled_scores_op is not None for i in indexers] == [pooled and i.is_candidate_source for i in indexers]
    calls = []
    for indexer_module in indexers:
        if indexer_module.pooled_scores_op is not None:
            op = indexer_module.pooled_scores_op
            indexer_module.pooled_scores_op = lambda *a, _op=op, **k: calls.append(a[0].shape[0]) or _op(*a, **k)
    return model, calls


@needs_triton
@torch.no_grad()
def test_v41_static_step_with_the_fused_pool_is_unchanged():
    outs = []
    for pooled in (False, True):
        model, calls = _v41_model(pooled)
        outs.append(torch.stack(run_rounds(StaticDecoderV41, model, None, rounds=2)))
        assert bool(calls) == pooled  # the static step's candidate source ran the fused op
    assert torch.equal(outs[1], outs[0])


@needs_triton
@torch.no_grad()
def test_v41_padded_pass_with_the_fused_pool_is_unchanged():
    """Three prefills (`select`, per request) then a ragged decode call of the 3 requests: the
    candidate source's padded pass (`select_batch`); logits equal with the fused op and without."""
    logits = []
    for pooled in (False, True):
        model, calls = _v41_model(pooled)
        g = torch.Generator().manual_seed(3)
        states = [model.new_state() for _ in range(3)]
        for state, n in zip(states, (9, 30, 17)):
            model(torch.randint(0, 256, (n,), generator=g), [state], [n])
        # one request at a time (`select`): the candidate source's per-request score passes, one group each
        assert calls == ([1] * 3 if pooled else [])
        calls.clear()
        logits.append(model(torch.randint(0, 256, (3,), generator=g), states, [1, 1, 1]).logits)
        assert calls == ([3] if pooled else [])  # one padded call for the 3 requests
    assert torch.equal(logits[1], logits[0])


# ----------------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("n_keys", [4096, 32_768])  # v41-mini's candidate source at 16K / 128K context (ratio 4)
def test_real_shapes_on_gpu(n_keys):
    """8 slots x 4 tokens, 32 index heads x 128 (bf16), blocks of 8, 2048 kept: the fused pool is the
    unfused pool, and the epilogue's block scores are the reference's of the same scores."""
    g = torch.Generator().manual_seed(n_keys)
    q = torch.randn(8, 4, 32, 128, generator=g).bfloat16().to(DEVICE)
    weights = torch.randn(8, 4, 32, generator=g).to(DEVICE)
    keys = torch.randn(8, n_keys, 128, generator=g).bfloat16().to(DEVICE)
    visible = torch.randint(0, n_keys + 1, (8, 4), generator=g).to(DEVICE)
    scores, bscores = indexer_pool.index_scores_pooled(q, weights, keys, visible, block=8)
    assert torch.equal(scores, indexer.index_scores(q, weights, keys, visible))
    flat = scores.flatten(0, 1), visible.flatten()
    assert torch.equal(bscores.flatten(0, 1), indexer_pool._block_scores_ref(*flat, 8))
    fused = indexer_pool.indexer_pool(*flat, topk_blocks=2048, block=8, bscores=bscores.flatten(0, 1))
    assert torch.equal(fused, indexer_pool.indexer_pool(*flat, topk_blocks=2048, block=8))
