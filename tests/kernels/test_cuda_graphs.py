"""The fused ops are CUDA-graph capturable: captured once, replayed on new data, equal to eager.

GPU only. The ops size every buffer from shapes and never read device values on the host, so a
replay after the inputs are overwritten in place must give exactly the eager result on the new data
(the kernels are deterministic: no atomics on floats, stable sort).
"""

import pytest
import torch

from dspark.kernels import hc_head_norm, indexer_pool, mhc, mhc_norm, mhc_v41, moe, norm_rope, rms_norm, rope
from dspark.kernels.fp8 import FP8BlockWeight

EPS = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)


def capture(fn):
    """Warm up on a side stream (compiles the kernels outside the capture), then capture fn()."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


def refill(*tensors):
    for t in tensors:
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 8, 64])
def test_mhc_ops_replay(n_tok):
    x = torch.randn(n_tok, 4, 2048, device="cuda").bfloat16()
    f = torch.randn(n_tok, 2048, device="cuda").bfloat16()
    fn = torch.randn(24, 8192, device="cuda") * 0.02
    base, scale = torch.randn(24, device="cuda"), torch.rand(3, device="cuda") + 0.5
    post, comb, _ = mhc.mhc_pre_ref(x, fn, base, scale, **EPS)

    weight = torch.rand(2048, device="cuda") + 0.5

    def step():
        return (*mhc.mhc_pre(x, fn, base, scale, **EPS), mhc.mhc_post(f, x, post, comb),
                *mhc.mhc_post_pre(f, x, post, comb, fn, base, scale, **EPS),
                *mhc_norm.mhc_pre_norm(x, fn, base, scale, weight, **EPS, norm_eps=1e-6),
                *mhc_norm.mhc_post_pre_norm(f, x, post, comb, fn, base, scale, weight, **EPS, norm_eps=1e-6),
                hc_head_norm.hc_head_norm(x, fn[:4], base[:4], scale[:1], weight, rms_eps=1e-6, hc_eps=1e-6,
                                          norm_eps=1e-6))

    graph, outs = capture(step)
    refill(x, f)
    graph.replay()
    torch.cuda.synchronize()
    for out, eager in zip(outs, step()):
        assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 64])
def test_norm_and_rope_replay(n_tok):
    """RMSNorm (hidden, weighted; per-head, unweighted, fp32 out) and RoPE of q heads, v4-mini sizes;
    norm + RoPE of q heads and of kv latents stored at rows of a ring."""
    x = torch.randn(n_tok, 2048, device="cuda").bfloat16()
    weight = torch.rand(2048, device="cuda") + 0.5
    q = torch.randn(n_tok, 32, 512, device="cuda").bfloat16()
    kv = torch.randn(n_tok, 512, device="cuda").bfloat16()
    ring, ring_rows = torch.zeros(2 * n_tok, 512, device="cuda").bfloat16(), torch.arange(n_tok, device="cuda") * 2
    cos, sin = torch.randn(n_tok, 32, device="cuda"), torch.randn(n_tok, 32, device="cuda")

    def step():
        return (rms_norm.rms_norm(x, weight, eps=1e-6, out_dtype=torch.bfloat16),
                rms_norm.rms_norm(q, None, eps=1e-6, out_dtype=torch.float32),
                rope.rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2)),
                norm_rope.norm_rope(q, None, cos.unsqueeze(-2), sin.unsqueeze(-2), eps=1e-6),
                norm_rope.norm_rope(kv, weight[:512], cos, sin, eps=1e-6, out=ring, out_rows=ring_rows))

    graph, outs = capture(step)
    refill(x, q, kv, cos, sin)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ring[ring_rows], outs[-1])
    for out, eager in zip(outs, step()):
        assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 64])
def test_v41_ops_replay(n_tok):
    """V4.1 single-pass mHC sites and the candidate pool (a streamed row: 131072 entries)."""
    x = torch.randn(n_tok, 4, 2048, device="cuda").bfloat16()
    f = torch.randn(n_tok, 2048, device="cuda").bfloat16()
    pre_in, post = torch.rand(n_tok, 4, device="cuda") + 0.1, torch.rand(n_tok, 4, device="cuda") * 2
    comb = torch.rand(n_tok, 4, 4, device="cuda")
    site = (torch.randn(24, 8192, device="cuda") * 0.02, torch.randn(24, device="cuda"),
            torch.rand(3, device="cuda") + 0.5, torch.rand(2048, device="cuda") + 0.5)
    scores = torch.randn(n_tok, 131072, device="cuda").clamp(min=0)
    visible = torch.full((n_tok,), 131072, device="cuda")
    eps = dict(EPS, norm_eps=1e-6)

    def step():
        return (*mhc_v41.mhc_v41_pre(x, pre_in, *site, **eps),
                *mhc_v41.mhc_v41_post_pre(f, x, post, comb, pre_in, *site, **eps),
                indexer_pool.indexer_pool(scores, visible, topk_blocks=2048, block=8))

    graph, outs = capture(step)
    refill(x, f, scores)
    scores.clamp_(min=0)  # ties at 0, as ReLU'd index scores have
    graph.replay()
    torch.cuda.synchronize()
    for out, eager in zip(outs, step()):
        assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_block", [None, 128])
@pytest.mark.parametrize("hash_routing", [False, True])
def test_fused_moe_replays(hash_routing, fp8_block):
    n_tok, dim, n_exp, inter = 8, 2048, 64, 512
    x = torch.randn(n_tok, dim, device="cuda").bfloat16()
    gate = (torch.randn(n_exp, dim, device="cuda") * dim ** -0.5).bfloat16()
    bias = torch.randn(n_exp, device="cuda") * 0.1
    tid2eid = torch.stack([torch.randperm(n_exp)[:6] for _ in range(100)]).cuda()
    token_ids = torch.randint(0, 100, (n_tok,), device="cuda")
    shapes = ((n_exp, inter, dim), (n_exp, dim, inter), (n_exp, inter, dim), (inter, dim), (dim, inter), (inter, dim))
    weights = [torch.randn(*s, device="cuda") * s[-1] ** -0.5 for s in shapes]
    weights = [w.bfloat16() if fp8_block is None else FP8BlockWeight.quantize(w, fp8_block) for w in weights]
    kw = dict(top_k=6, routed_scaling_factor=1.5, swiglu_limit=10.0, hash_routing=hash_routing)

    def step():
        return moe.fused_moe(x, gate, bias, tid2eid, token_ids, *weights, **kw)

    graph, out = capture(step)
    refill(x)
    token_ids.copy_(torch.randint(0, 100, (n_tok,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())
