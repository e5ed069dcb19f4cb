"""Decode router (dspark/kernels/moe_route_decode.py): split-K logits + select kernel vs `moe_route_ref`.

On CPU the kernels run in the Triton interpreter (tests/kernels/conftest.py) on tiny shapes that still
reach every case: one split and many, several reduction steps per split with a ragged last one, E and
D off the tiles, E not a power of 2, hash and score routing, exact ties and near-ties.
"""

import pytest
import torch

from dspark.kernels import moe, triton_available
from test_moe import DEVICE, router_inputs  # noqa: E402 (tests/kernels is on sys.path: prepend mode)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")

CASES = [  # (N, D, E, K)
    (1, 200, 64, 6),  # one token, v4-mini's E; D off the 64-wide step (4 splits of one step)
    (1, 72, 8, 2),  # E below tl.dot's 16: padded experts masked
    (3, 48, 8, 2),  # D shorter than one step: a single split
    (3, 130, 72, 6),  # E not a power of 2
    (16, 136, 72, 6),  # a full 16-token tile
    (16, 96, 64, 6),
    (64, 1000, 72, 4),  # 4 token tiles; 2 steps per split, the last split ragged
    (64, 40, 8, 3),
]


def route(n_tok, dim, n_exp, top_k, dtype, hash_routing, poisoned, tiles=None):
    from dspark.kernels import moe_route_decode

    args = router_inputs(n_tok, dim, n_exp, top_k, dtype, seed=n_tok * 1000 + dim)
    kwargs = dict(top_k=top_k, routed_scaling_factor=1.5, hash_routing=hash_routing)
    with poisoned():  # the [S, N, E] partials and both outputs start as NaN / -1
        out = moe_route_decode.route_decode(*args, **kwargs, tiles=tiles)
    return out, moe.moe_route_ref(*args, **kwargs)


@pytest.mark.parametrize("hash_routing", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tok,dim,n_exp,top_k", CASES)
def test_route_decode_matches_ref(n_tok, dim, n_exp, top_k, dtype, hash_routing, poisoned):
    (weights, ids), (ref_w, ref_ids) = route(n_tok, dim, n_exp, top_k, dtype, hash_routing, poisoned)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)  # the same experts in the same order
    torch.testing.assert_close(weights, ref_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hash_routing", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tok,dim,n_exp,top_k", CASES[::2])
def test_route_prefill_matches_ref(n_tok, dim, n_exp, top_k, dtype, hash_routing, poisoned):
    """The prefill kernel (which `moe_route` now reaches only above ROUTE_DECODE_MAX_TOKENS tokens)."""
    args = router_inputs(n_tok, dim, n_exp, top_k, dtype, seed=n_tok * 1000 + dim)
    kwargs = dict(top_k=top_k, routed_scaling_factor=1.5, hash_routing=hash_routing)
    with poisoned():
        weights, ids = moe.route_prefill(*args, **kwargs)
    ref_w, ref_ids = moe.moe_route_ref(*args, **kwargs)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tiles", [(16, 16, 4, 4), (64, 32, 1000, 8), (32, 128, 7, 2), (16, 16, 1, 1)])
def test_route_decode_any_tiles(tiles, poisoned):
    """Every launch shape the bench sweeps gives the reference's routing: many or one split,
    several steps per split, block_e wider than E, a block_k wider than D."""
    from dspark.kernels import moe_route_decode

    tiles = moe_route_decode.RouteTiles(*tiles)
    (weights, ids), (ref_w, ref_ids) = route(5, 200, 72, 6, torch.float32, False, poisoned, tiles)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-5, rtol=1e-5)


def tie_inputs(dtype):
    """x [3, 96], gate [72, 96] of small integers × powers of 2, so every logit is exact in fp32
    whatever the summation order; experts 2 and 5 tie exactly, 9 is 2^-9 from them, 3 and 11 tie
    exactly; bias 4 puts 2, 5, 9 first for every token."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (3, 96), generator=g).float() / 8
    gate = torch.randint(-8, 9, (72, 96), generator=g).float() / 64
    gate[5] = gate[2]
    gate[9] = gate[2]
    gate[9, 0] += 1 / 64  # x[:, 0] != 0 below: a logit gap of |x[t, 0]| / 64 >= 2^-9
    gate[11] = gate[3]
    x[:, 0] = torch.tensor([1.0, -0.5, 0.125])
    bias = torch.zeros(72)
    bias[[2, 5, 9]] = 4.0
    return x.to(DEVICE, dtype), gate.to(DEVICE, dtype), bias.to(DEVICE)


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_ties_pick_lowest_expert_id(path, dtype, poisoned):
    """Exact ties go to the lowest expert id, near-ties to the larger score, in both router paths."""
    from dspark.kernels import moe_route_decode

    x, gate, bias = tie_inputs(dtype)
    fn = moe_route_decode.route_decode if path == "decode" else moe.route_prefill
    with poisoned():
        weights, ids = fn(x, gate, bias, None, None, top_k=6, routed_scaling_factor=1.5, hash_routing=False)
    scores = torch.sqrt(torch.nn.functional.softplus(x.double() @ gate.double().T))  # exact logits
    want = torch.sort(scores + bias.double(), dim=-1, descending=True, stable=True).indices[:, :6]
    assert torch.equal(ids.long().cpu(), want.cpu())
    assert ids[:, :3].tolist() == [[9, 2, 5], [2, 5, 9], [9, 2, 5]]  # sign of x[t, 0] orders 9 vs 2 = 5
    picked = scores.gather(1, want)
    torch.testing.assert_close(weights.double(), picked / picked.sum(-1, keepdim=True) * 1.5, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n_tok", [1, moe.ROUTE_DECODE_MAX_TOKENS, moe.ROUTE_DECODE_MAX_TOKENS + 1])
def test_moe_route_picks_path_by_token_count(n_tok, monkeypatch):
    """`moe_route` runs the split-K decode router up to ROUTE_DECODE_MAX_TOKENS tokens (never the
    serial prefill kernel) and the prefill kernel above."""
    from dspark.kernels import moe_route_decode

    def fail(*args, **kwargs):
        raise AssertionError(f"wrong router path for {n_tok} tokens")

    decode = n_tok <= moe.ROUTE_DECODE_MAX_TOKENS
    if decode:
        monkeypatch.setattr(moe, "_moe_route_kernel", fail)
    else:
        monkeypatch.setattr(moe_route_decode, "route_decode", fail)
    args = router_inputs(n_tok, 32, 8, 2, torch.float32, seed=1)
    kwargs = dict(top_k=2, routed_scaling_factor=1.5, hash_routing=False)
    weights, ids = moe.moe_route(*args, **kwargs)
    ref_w, ref_ids = moe.moe_route_ref(*args, **kwargs)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_exp", [2, 8, 64, 72, 256, 384])
@pytest.mark.parametrize("n_tok", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("dim", [16, 200, 2048, 4096, 7168])
def test_plan_route_covers_dim_with_nonempty_splits(n_tok, dim, n_exp):
    from dspark.kernels import moe_route_decode as rd

    for tiles in (rd.RouteTiles(), rd.RouteTiles(block_e=16, block_k=128, programs=512)):
        plan = rd.plan_route(n_tok, dim, n_exp, tiles)
        k_steps = -(-dim // plan.block_k)
        assert (plan.splits - 1) * plan.chunk_steps < k_steps <= plan.splits * plan.chunk_steps  # none empty
        assert plan.splits <= plan.s_pad < 2 * plan.splits and plan.s_pad & (plan.s_pad - 1) == 0
        assert plan.e_pad >= max(n_exp, 16) and plan.s_pad * plan.e_pad <= 8192
        assert 16 <= plan.block_e <= plan.e_pad
        programs = -(-n_tok // 16) * -(-n_exp // plan.block_e) * plan.splits
        if k_steps >= tiles.programs and plan.e_pad * tiles.programs <= 8192:
            assert programs >= tiles.programs // 2  # the split spreads one token over the GPU


def test_route_tiles_rejected():
    from dspark.kernels import moe_route_decode as rd

    for bad, name in (((24, 64, 128, 4), "block_e"), ((32, 8, 128, 4), "block_k"), ((32, 64, 0, 4), "programs"),
                      ((32, 64, 128, 3), "warps")):
        with pytest.raises(ValueError, match=name):
            rd.plan_route(1, 2048, 64, rd.RouteTiles(*bad))


# ----------------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 8, 64, 256])
@pytest.mark.parametrize("dim,n_exp", [(2048, 64), (4096, 256)])  # v4-mini, V4-Flash
def test_route_decode_real_shapes_on_gpu(n_tok, dim, n_exp):
    """bf16 at the real layer sizes: the expert sets of the decode path, the prefill kernel and the
    reference agree (a near-tie of ~1e-7 may flip a rare token), results repeat bit for bit, and a
    CUDA-graph replay on new inputs equals the eager call."""
    from dspark.kernels import moe_route_decode

    x, gate, bias, _, _ = router_inputs(n_tok, dim, n_exp, 6, torch.bfloat16, seed=n_tok)
    kw = dict(top_k=6, routed_scaling_factor=2.5, hash_routing=False)
    weights, ids = moe_route_decode.route_decode(x, gate, bias, None, None, **kw)
    for other_w, other_ids in (moe.route_prefill(x, gate, bias, None, None, **kw),
                               moe.moe_route_ref(x, gate, bias, None, None, **kw)):
        same = (ids.sort(-1).values == other_ids.sort(-1).values).all(-1)
        assert same.float().mean() >= 0.99
        torch.testing.assert_close(weights[same], other_w[same], atol=1e-5, rtol=1e-5)
    again = moe_route_decode.route_decode(x, gate, bias, None, None, **kw)
    assert torch.equal(again[0], weights) and torch.equal(again[1], ids)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe.moe_route(x, gate, bias, None, None, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = moe.moe_route(x, gate, bias, None, None, **kw)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    eager = moe.moe_route(x, gate, bias, None, None, **kw)
    assert torch.equal(outs[0], eager[0]) and torch.equal(outs[1], eager[1])


def token_bias(args, seed):
    """`router_inputs`' args with one random selection-bias row per token ([N, E] fp32) in place of
    the shared [E] bias: big enough that every row picks its own experts."""
    x, gate, bias = args[:3]
    g = torch.Generator().manual_seed(seed)
    rows = bias.cpu() + torch.randn(x.shape[0], bias.shape[0], generator=g)
    return (x, gate, rows.to(bias.device), *args[3:])


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("n_tok,dim,n_exp,top_k", CASES[::3])
def test_moe_route_rows_matches_ref(n_tok, dim, n_exp, top_k, path, poisoned):
    """`moe_route_rows`: each token selects with its own bias row (V4.1's image-span tokens use
    `bias_vl`), on both router kernels; the picks follow the row, not the shared bias."""
    args = token_bias(router_inputs(n_tok, dim, n_exp, top_k, torch.float32, seed=n_tok + dim), seed=n_tok)
    kwargs = dict(top_k=top_k, routed_scaling_factor=1.5, hash_routing=False)
    with poisoned():
        if path == "decode":
            weights, ids = moe.moe_route_rows(*args, **kwargs)
        else:
            weights, ids = moe.route_prefill(*args, **kwargs, bias_rows=True)
    ref_w, ref_ids = moe.moe_route_rows_ref(*args, **kwargs)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-5, rtol=1e-5)
    shared = moe.moe_route_ref(*args[:2], args[2][0], *args[3:], **kwargs)[1]  # every token with row 0's bias
    assert n_tok == 1 or not torch.equal(ids, shared)


def test_moe_route_rows_checks_its_bias():
    args = router_inputs(3, 32, 8, 2, torch.float32, seed=0)
    kwargs = dict(top_k=2, routed_scaling_factor=1.5)
    with pytest.raises(ValueError, match=r"gate_bias must be \[N=3, E=8\]"):
        moe.moe_route_rows_ref(*args, **kwargs)  # the shared [E] bias
    with pytest.raises(ValueError, match=r"gate_bias must be \[E=8\]"):
        moe.moe_route_ref(*token_bias(args, 0), **kwargs, hash_routing=False)
    with pytest.raises(ValueError, match="score routing only"):
        moe.moe_route_rows_ref(*token_bias(args, 0), **kwargs, hash_routing=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 8, 300])  # the decode router, and the prefill kernel above 256
@pytest.mark.parametrize("dim,n_exp", [(2048, 64), (4096, 256)])
def test_moe_route_rows_real_shapes_on_gpu(n_tok, dim, n_exp):
    """bf16 at the real layer sizes, each token selecting with its own bias row: the expert sets agree
    with the reference (a near-tie may flip a rare token), the weights where they agree."""
    args = token_bias(router_inputs(n_tok, dim, n_exp, 6, torch.bfloat16, seed=n_tok), seed=n_tok)
    kw = dict(top_k=6, routed_scaling_factor=2.5)
    weights, ids = moe.moe_route_rows(*args, **kw)
    ref_w, ref_ids = moe.moe_route_rows_ref(*args, **kw)
    same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
    assert same.float().mean() >= 0.99
    torch.testing.assert_close(weights[same], ref_w[same], atol=1e-5, rtol=1e-5)
