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


# ------------------------------------------------------------------- one launch: ticket counters per tile


FOLD_SHAPES = [(n_tok, dim, n_exp) for n_exp, dim in ((64, 256), (256, 512)) for n_tok in (1, 2, 3, 4)]


def routing_mode(mode, n_tok, dim, n_exp, dtype):
    """(args, kwargs of `route_decode`, the registry op with that routing, its reference): score routing
    with a shared [E] bias, hash routing, or one bias row per token (`moe_route_rows`)."""
    args = router_inputs(n_tok, dim, n_exp, 6, dtype, seed=n_tok * 7 + n_exp)
    kwargs = dict(top_k=6, routed_scaling_factor=1.5, hash_routing=mode == "hash")
    if mode != "rows":
        return args, kwargs, moe.moe_route, moe.moe_route_ref
    return token_bias(args, seed=n_tok), dict(kwargs, bias_rows=True), moe.moe_route_rows, moe.moe_route_rows_ref


def forbid(monkeypatch, module, name):
    """Make kernel `name` of `module` fail when launched (which mode ran)."""
    def launch(grid):
        raise AssertionError(f"{name} launched")

    monkeypatch.setattr(module, name, type("Forbidden", (), {"__getitem__": lambda self, grid: launch(grid)})())


@pytest.mark.parametrize("mode", ["score", "hash", "rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tok,dim,n_exp", FOLD_SHAPES)
def test_route_one_launch_equals_two_launches(n_tok, dim, n_exp, dtype, mode, poisoned, monkeypatch):
    """With a tickets buffer and N <= SELECT_FOLD_MAX_TOKENS the registry ops route in one launch
    (`_route_fold_kernel`; the select kernel never runs): weights and ids are the two launches' bits,
    the reference's picks; the buffer is all zero after each call, and a second call on the same
    buffer (which needs the counters back at 0) gives the same bits again."""
    from dspark.kernels import moe_route_decode as rd

    args, kwargs, op, ref = routing_mode(mode, n_tok, dim, n_exp, dtype)
    with poisoned():
        split_w, split_ids = rd.route_decode(*args, **kwargs)
    tickets = rd.route_tickets()
    forbid(monkeypatch, rd, "_route_select_kernel")
    forbid(monkeypatch, rd, "_route_logits_kernel")
    op_kwargs = {k: v for k, v in kwargs.items() if k != "bias_rows"}
    for _ in range(2):
        with poisoned():
            weights, ids = op(*args, **op_kwargs, tickets=tickets)
        assert torch.equal(ids, split_ids) and torch.equal(weights, split_w)
        assert tickets.shape == (moe.ROUTE_DECODE_MAX_TOKENS // 16,) and not tickets.any()
    ref_w, ref_ids = ref(*args, **op_kwargs, tickets=tickets)  # the reference takes and ignores it
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tiles", [(16, 16, 4, 4), (64, 32, 1000, 8), (16, 16, 1, 1)])
def test_route_one_launch_any_tiles(tiles, poisoned):
    """One split or many, block_e wider than E: the last program of the tile sums the same parts. A
    buffer of exactly ⌈N/16⌉ counters is enough."""
    from dspark.kernels import moe_route_decode as rd

    args = router_inputs(rd.SELECT_FOLD_MAX_TOKENS, 200, 72, 6, torch.float32, seed=11)
    kwargs = dict(top_k=6, routed_scaling_factor=1.5, hash_routing=False, tiles=rd.RouteTiles(*tiles))
    tickets = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with poisoned():
        one = rd.route_decode(*args, **kwargs, tickets=tickets)
        two = rd.route_decode(*args, **kwargs)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1]) and not tickets.any()


def test_route_tickets_above_the_fold_run_two_launches(poisoned, monkeypatch):
    """Above SELECT_FOLD_MAX_TOKENS tokens a tickets buffer changes nothing: the two launches run
    (the one-launch kernel never does), the same bits, the buffer untouched."""
    from dspark.kernels import moe_route_decode as rd

    n_tok = rd.SELECT_FOLD_MAX_TOKENS + 1
    args = router_inputs(n_tok, 256, 64, 6, torch.float32, seed=5)
    kwargs = dict(top_k=6, routed_scaling_factor=1.5, hash_routing=False)
    with poisoned():
        want = rd.route_decode(*args, **kwargs)
    forbid(monkeypatch, rd, "_route_fold_kernel")
    tickets = rd.route_tickets()
    with poisoned():
        got = moe.moe_route(*args, **kwargs, tickets=tickets)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and not tickets.any()


def test_route_tickets_checked():
    """A tickets buffer of the wrong dtype, too short, not contiguous or not a tensor is a ValueError
    naming it, from `route_decode` and through the registry op."""
    from dspark.kernels import moe_route_decode as rd

    args = router_inputs(2, 64, 8, 2, torch.float32, seed=0)
    kwargs = dict(top_k=2, routed_scaling_factor=1.5, hash_routing=False)
    bad = ((torch.zeros(16, dtype=torch.int64, device=DEVICE), "int32, got torch.int64"),
           (torch.zeros(0, dtype=torch.int32, device=DEVICE), ">= 1 counters for N=2 tokens, got 0"),
           (torch.zeros(4, 2, dtype=torch.int32, device=DEVICE).t(), "contiguous"),
           ([0], "tensor or None, got list"))
    for tickets, message in bad:
        for fn in (rd.route_decode, moe.moe_route):
            with pytest.raises(ValueError, match=message):
                fn(*args, **kwargs, tickets=tickets)
    assert rd.ticket_count(16) == 1 and rd.ticket_count(17) == 2
    assert rd.route_tickets(max_tokens=33).tolist() == [0, 0, 0]


def test_route_ops_and_references_share_their_signature():
    """Every router op and its reference take the same parameters, `tickets` among them."""
    import inspect

    for name in ("moe_route", "moe_route_rows", "fused_moe"):
        op, ref = getattr(moe, name), getattr(moe, f"{name}_ref")
        assert inspect.signature(op).parameters.keys() == inspect.signature(ref).parameters.keys(), name
        assert inspect.signature(op).parameters["tickets"].default is None, name


def test_model_routes_with_its_tickets_buffer(monkeypatch):
    """A tiny V4 model with the fused MoE ops: each MoE layer owns a zeroed int32 `route_tickets` buffer
    (non-persistent: not in the state_dict; it follows `.to`), decode steps route in one launch with
    it, and the logits are the same bits as with the buffers taken away (two launches per router);
    every buffer is zero after the steps."""
    import copy

    import dspark
    from dspark.kernels import KernelConfig
    from dspark.kernels import moe_route_decode as rd

    fused = KernelConfig(fused_moe="triton", moe_route="triton", moe_experts="triton")
    model = dspark.init_model("tiny-v4", seed=0, kernels=fused).to(DEVICE)
    layers = [layer.ffn for layer in model.layers]
    assert all(ffn.route_tickets.dtype == torch.int32 and not ffn.route_tickets.any() for ffn in layers)
    assert not any(key.endswith("route_tickets") for key in model.state_dict())
    assert copy.deepcopy(layers[0]).to("meta").route_tickets.is_meta
    folds = []
    kernel = rd._route_fold_kernel
    monkeypatch.setattr(rd, "_route_fold_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: folds.append(grid) or kernel[grid]})())

    def run():
        g = torch.Generator().manual_seed(1)
        states = [model.new_state() for _ in range(2)]
        prompt = torch.randint(0, model.config.vocab_size, (9,), generator=g)
        logits = [model(prompt.to(DEVICE), states, [5, 4]).logits]  # 9 tokens: two launches
        for _ in range(2):  # 2 tokens, one per request: one launch per router
            nxt = torch.randint(0, model.config.vocab_size, (2,), generator=g)
            logits.append(model(nxt.to(DEVICE), states, [1, 1]).logits)
        return logits

    with torch.no_grad():
        with_tickets = run()
        assert len(folds) == 2 * len(layers) and not any(ffn.route_tickets.any() for ffn in layers)
        for ffn in layers:
            ffn.route_tickets = None  # the router ops' default: two launches
        without = run()
    assert len(folds) == 2 * len(layers)
    for a, b in zip(with_tickets, without):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 2, 3, 4])
@pytest.mark.parametrize("dim,n_exp", [(2048, 64), (4096, 256)])  # v4-mini, V4-Flash
def test_route_one_launch_real_shapes_on_gpu(n_tok, dim, n_exp):
    """bf16 at the real layer sizes on the GPU, where the tile's programs run on many SMs at once: the
    one launch gives the two launches' bits (at these shapes both selects run at 4 warps, one reduction
    layout) on every one of many calls on one buffer, which stays zero, and a CUDA-graph replay on new
    inputs equals the eager call."""
    from dspark.kernels import moe_route_decode as rd

    x, gate, bias, _, _ = router_inputs(n_tok, dim, n_exp, 6, torch.bfloat16, seed=n_tok)
    kw = dict(top_k=6, routed_scaling_factor=2.5, hash_routing=False)
    tickets = rd.route_tickets(x.device)
    want = rd.route_decode(x, gate, bias, None, None, **kw)
    for _ in range(50):
        got = moe.moe_route(x, gate, bias, None, None, **kw, tickets=tickets)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.cuda.synchronize()
    assert not tickets.any()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe.moe_route(x, gate, bias, None, None, **kw, tickets=tickets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = moe.moe_route(x, gate, bias, None, None, **kw, tickets=tickets)
    x.copy_(torch.randn_like(x))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    eager = rd.route_decode(x, gate, bias, None, None, **kw)
    assert torch.equal(outs[0], eager[0]) and torch.equal(outs[1], eager[1]) and not tickets.any()
