"""V4.1 single-pass mHC kernels (dspark/kernels/mhc_v41.py): fused Triton vs torch reference, and
the reference vs the model's torch path (deepseek_v41 spec §4).

On CPU the Triton kernels run under the interpreter (conftest.py) on tiny shapes that cross every
block edge: N not a multiple of the token tiles, D not a multiple of the D tiles, several split-K
partials, n_hc = 3 (padded to 4), N > 256 (the prefill tiles).
"""

import pytest
import torch

from dspark.kernels import mhc_v41, triton_available
from dspark.models.deepseek_v4.mhc import collapse, hc_post, split_mixes, stream_mixes
from dspark.models.deepseek_v4.norm import RMSNorm

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # ‖Δ‖/‖ref‖, as tests/kernels/test_mhc.py (METHOD.md)
EPS = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=1e-6)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in output: an element was not written"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def site(n_tok: int, n_hc: int, dim: int, dtype: torch.dtype, seed: int):
    """Random streams x [N, H, D], carried pre [N, H] (σ + eps range, never 0) and one site's
    parameters (fn, base, scale, norm weight), base ~ N(0, 0.5), scale ~ U(0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    n_mix = (2 + n_hc) * n_hc
    x = torch.randn(n_tok, n_hc, dim, generator=g).to(dtype)
    pre_in = torch.rand(n_tok, n_hc, generator=g) * 0.9 + 0.1
    params = (torch.randn(n_mix, n_hc * dim, generator=g) * 0.05, torch.randn(n_mix, generator=g) * 0.5,
              torch.rand(3, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5)
    return x.to(DEVICE), pre_in.to(DEVICE), [p.to(DEVICE) for p in params]


def finished_site(n_tok: int, n_hc: int, dim: int, dtype: torch.dtype, seed: int):
    """A sublayer output f [N, D] and the (post, comb) of the site that ran it, from the reference."""
    x, pre_in, params = site(n_tok, n_hc, dim, dtype, seed)
    _, post, comb, _ = mhc_v41.mhc_v41_pre_ref(x, pre_in, *params, **EPS)
    f = torch.randn(n_tok, dim, generator=torch.Generator().manual_seed(seed + 1)).to(device=DEVICE, dtype=dtype)
    return f, x, post, comb


SHAPES = [(1, 4, 256), (5, 4, 96), (19, 3, 64), (300, 4, 64)]  # (N, n_hc, D)


# ---------------------------------------------------------------------- reference vs the model path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_is_the_model_torch_path_bit_for_bit(dtype):
    """The block's reference path is unchanged: the op equals Mix (stream_mixes + split_mixes),
    collapse with the carried pre and the sublayer RMSNorm, exactly."""
    x, pre_in, (fn, base, scale, weight) = site(7, 4, 48, dtype, seed=1)
    eps = dict(EPS, rms_eps=1e-20)  # V4.1's statistic eps
    norm = RMSNorm(48, eps["norm_eps"], device=DEVICE)
    norm.weight.data.copy_(weight)
    pre, post, comb, h = mhc_v41.mhc_v41_pre_ref(x, pre_in, fn, base, scale, weight, **eps)
    want = split_mixes(stream_mixes(x, fn, eps["rms_eps"]), scale, base, 4, eps["sinkhorn_iters"], eps["hc_eps"])
    for out, ref in zip((pre, post, comb, h), (*want, norm(collapse(x, pre_in)))):
        assert out.dtype == ref.dtype and torch.equal(out, ref)

    f = torch.randn(7, 48).to(device=DEVICE, dtype=dtype)
    y, *rest = mhc_v41.mhc_v41_post_pre_ref(f, x, post, comb, pre, fn, base, scale, weight, **eps)
    assert torch.equal(y, hc_post(f, x, post, comb))
    for out, ref in zip(rest, mhc_v41.mhc_v41_pre_ref(y, pre, fn, base, scale, weight, **eps)):
        assert torch.equal(out, ref)


def test_ref_layer0_one_hot_pre_normalises_stream_0():
    """Spec §4: with the one-hot carried pre of layer 0 the sublayer input is RMSNorm(X_0)."""
    x, _, (fn, base, scale, weight) = site(3, 4, 32, torch.float32, seed=2)
    one_hot = torch.zeros(3, 4, device=DEVICE)
    one_hot[:, 0] = 1.0
    h = mhc_v41.mhc_v41_pre_ref(x, one_hot, fn, base, scale, weight, **EPS)[3]
    x0 = x[:, 0]
    torch.testing.assert_close(h, weight * x0 * torch.rsqrt(x0.square().mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("bad", ["pre_in", "pre_in_dtype", "norm_weight"])
def test_rejects_bad_arguments(bad):
    x, pre_in, (fn, base, scale, weight) = site(2, 4, 8, torch.float32, seed=3)
    if bad == "pre_in":
        pre_in = pre_in[:, :3]
    elif bad == "pre_in_dtype":
        pre_in = pre_in.double()
    else:
        weight = weight[:4]
    with pytest.raises(ValueError, match=bad.removesuffix("_dtype")):
        mhc_v41.mhc_v41_pre_ref(x, pre_in, fn, base, scale, weight, **EPS)


# ------------------------------------------------------------------------------- fused vs reference


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tok,n_hc,dim", SHAPES)
def test_pre_fused_matches_ref(n_tok, n_hc, dim, dtype, poisoned):
    x, pre_in, params = site(n_tok, n_hc, dim, dtype, seed=n_tok + dim)
    with poisoned():
        fused = mhc_v41.mhc_v41_pre(x, pre_in, *params, **EPS)
    for out, want in zip(fused, mhc_v41.mhc_v41_pre_ref(x, pre_in, *params, **EPS)):
        assert out.shape == want.shape and out.dtype == want.dtype
        assert rel_err(out, want) < TOL[dtype]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tok,n_hc,dim", SHAPES)
def test_post_pre_fused_matches_ref(n_tok, n_hc, dim, dtype, poisoned):
    f, x, post, comb = finished_site(n_tok, n_hc, dim, dtype, seed=5)
    _, pre_in, params = site(n_tok, n_hc, dim, dtype, seed=6)
    with poisoned():
        fused = mhc_v41.mhc_v41_post_pre(f, x, post, comb, pre_in, *params, **EPS)
    for out, want in zip(fused, mhc_v41.mhc_v41_post_pre_ref(f, x, post, comb, pre_in, *params, **EPS)):
        assert out.shape == want.shape and out.dtype == want.dtype
        assert rel_err(out, want) < TOL[dtype]


@needs_triton
def test_fused_collapses_with_the_carried_pre_not_its_own():
    """Two carried pres on the same streams give different sublayer inputs but the same mixes."""
    x, pre_in, params = site(5, 4, 64, torch.float32, seed=8)
    a = mhc_v41.mhc_v41_pre(x, pre_in, *params, **EPS)
    b = mhc_v41.mhc_v41_pre(x, pre_in.flip(-1), *params, **EPS)
    for out_a, out_b in zip(a[:3], b[:3]):
        torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)
    assert rel_err(b[3], a[3]) > 0.1
    assert rel_err(b[3], mhc_v41.mhc_v41_pre_ref(x, pre_in.flip(-1), *params, **EPS)[3]) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("n_tok,n_hc,dim,dtype", [(1, 4, 1100, torch.float32), (3, 4, 256, torch.bfloat16),
                                                  (4, 3, 200, torch.float32), (8, 4, 256, torch.bfloat16),
                                                  (32, 4, 128, torch.bfloat16)])
def test_few_tokens_split_the_streams_over_programs(n_tok, n_hc, dim, dtype, monkeypatch, poisoned):
    """Up to SPLIT_STREAMS_MAX_TOKENS tokens each statistics program takes one stream of one split
    (HC × splits GEMM partials, one Σu² partial per split; here several D-splits of several D-blocks
    each, with the SM count raised): the collapse u equals the unsplit pass's bit for bit (same
    stream order), and pre and post+pre equal the references with the epilogue's one-round reduce."""
    monkeypatch.setattr(mhc_v41, "_num_sms", lambda device: 16)
    assert n_tok <= mhc_v41.SPLIT_STREAMS_MAX_TOKENS
    x, pre_in, params = site(n_tok, n_hc, dim, dtype, seed=n_tok + dim)
    f, _, post, comb = finished_site(n_tok, n_hc, dim, dtype, seed=9)
    for fused in (None, (f, post, comb, torch.empty_like(x))):
        u, dpart, sqpart, uqpart = mhc_v41._launch_stats(x, pre_in, params[0], fused)
        block_t, block_d, _ = mhc_v41._v41_tiles(n_tok, fused is not None)  # the split tiles
        n_dblocks, n_tblocks = -(-dim // block_d), -(-n_tok // block_t)
        splits = min(n_dblocks, -(-32 // (n_tblocks * n_hc)))
        assert dpart.shape[0] == sqpart.shape[0] == n_hc * splits and uqpart.shape[0] == splits
        with monkeypatch.context() as unsplit:
            unsplit.setattr(mhc_v41, "SPLIT_STREAMS_MAX_TOKENS", 0)
            block_t, block_d, _ = mhc_v41._v41_tiles(n_tok, fused is not None)  # the unsplit tiles
            u_unsplit, dpart_unsplit, *_ = mhc_v41._launch_stats(x, pre_in, params[0], fused)
        assert dpart_unsplit.shape[0] == min(-(-dim // block_d), -(-32 // -(-n_tok // block_t)))
        assert torch.equal(u, u_unsplit)
    with poisoned():
        got = mhc_v41.mhc_v41_pre(x, pre_in, *params, **EPS)
    for out, want in zip(got, mhc_v41.mhc_v41_pre_ref(x, pre_in, *params, **EPS)):
        assert rel_err(out, want) < TOL[dtype]
    with poisoned():
        got = mhc_v41.mhc_v41_post_pre(f, x, post, comb, pre_in, *params, **EPS)
    for out, want in zip(got, mhc_v41.mhc_v41_post_pre_ref(f, x, post, comb, pre_in, *params, **EPS)):
        assert rel_err(out, want) < TOL[dtype]


@needs_triton
@pytest.mark.parametrize("n_tok,n_hc,dim,dtype", [(1, 4, 256, torch.bfloat16), (8, 3, 200, torch.float32),
                                                  (40, 4, 96, torch.bfloat16)])
def test_mixes_launched_apart_give_the_same_bits(n_tok, n_hc, dim, dtype, poisoned, counted_lane):
    """With `mixes_on` the epilogue is two launches, h (NORM) on the caller's stream and the mixes
    (MIXES: partials, sigmoids, Sinkhorn) under `mixes_on()` (the static step's side stream): each
    output equals the one-launch epilogue's bit for bit, at both sites, split and unsplit streams."""
    x, pre_in, params = site(n_tok, n_hc, dim, dtype, seed=n_tok + 3)
    f, _, post, comb = finished_site(n_tok, n_hc, dim, dtype, seed=5)
    for op, args in ((mhc_v41.mhc_v41_pre, (x, pre_in, *params)),
                     (mhc_v41.mhc_v41_post_pre, (f, x, post, comb, pre_in, *params))):
        whole = op(*args, **EPS)
        with poisoned():
            apart = op(*args, **EPS, mixes_on=counted_lane)
        assert len(whole) == len(apart) and all(torch.equal(a, b) for a, b in zip(whole, apart))
        ref = (mhc_v41.mhc_v41_pre_ref if op is mhc_v41.mhc_v41_pre else mhc_v41.mhc_v41_post_pre_ref)(
            *args, **EPS, mixes_on=counted_lane)  # the reference takes it and runs in order
        assert all(rel_err(a, b) < TOL[dtype] for a, b in zip(apart, ref))
    assert counted_lane.entered == 2


# ----------------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 8, 32, 64, 512])
@pytest.mark.parametrize("dim", [2048, 4096])
def test_real_shapes_on_gpu(n_tok, dim):
    eps = dict(EPS, rms_eps=1e-20)
    x, pre_in, params = site(n_tok, 4, dim, torch.bfloat16, seed=0)
    for out, want in zip(mhc_v41.mhc_v41_pre(x, pre_in, *params, **eps),
                         mhc_v41.mhc_v41_pre_ref(x, pre_in, *params, **eps)):
        assert rel_err(out, want) < TOL[torch.bfloat16]
    f, x, post, comb = finished_site(n_tok, 4, dim, torch.bfloat16, seed=1)
    for out, want in zip(mhc_v41.mhc_v41_post_pre(f, x, post, comb, pre_in, *params, **eps),
                         mhc_v41.mhc_v41_post_pre_ref(f, x, post, comb, pre_in, *params, **eps)):
        assert rel_err(out, want) < TOL[torch.bfloat16]
