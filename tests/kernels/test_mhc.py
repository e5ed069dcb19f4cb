"""mHC kernels (dspark/kernels/mhc.py): fused Triton vs torch reference, and the reference vs spec §6.

On CPU the Triton kernels run under the interpreter (tests/kernels/conftest.py), on tiny shapes that
still cross every block edge: N not a multiple of the token tiles, D not a multiple of the D tile,
more than one split-K partial, n_hc = 3 (padded to 4 inside the kernels).
"""

import math

import pytest
import torch

from dspark.kernels import triton_available
from dspark.kernels import mhc
from dspark.models.deepseek_v4.mhc import hc_post, hc_pre

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # ‖Δ‖/‖ref‖: fp32 math vs bf16 storage (METHOD.md)
EPS = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in output: an element was not written"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def site_params(n_hc: int, dim: int, seed: int):
    """Random mHC parameters with the §18.1 sensitivity recipe: base ~ N(0, 0.5), scale ~ U(0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    n_mix = (2 + n_hc) * n_hc
    fn = torch.randn(n_mix, n_hc * dim, generator=g) * 0.05
    base = torch.randn(n_mix, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    return fn.to(DEVICE), base.to(DEVICE), scale.to(DEVICE)


def streams(n_tok: int, n_hc: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_tok, n_hc, dim, generator=g).to(device=DEVICE, dtype=dtype)


def prev_site(n_tok: int, n_hc: int, dim: int, dtype: torch.dtype, seed: int):
    """A sublayer output f and a previous site's (post, comb) as mhc_pre_ref would produce them."""
    x = streams(n_tok, n_hc, dim, dtype, seed)
    post, comb, _ = mhc.mhc_pre_ref(x, *site_params(n_hc, dim, seed + 1), **EPS)
    f = streams(n_tok, 1, dim, dtype, seed + 2)[:, 0]
    return f, x, post, comb


# (N, n_hc, D): decode sizes N = 1, 3, 5, 16 (one token block), N = 16 with n_hc = 3 and D not a
# multiple of the D tile, D = 1000 (4 D-blocks per split on CPU); N = 19: two token blocks; N > 256:
# prefill tiles.
SHAPES = [(1, 4, 256), (3, 4, 1000), (5, 4, 96), (16, 3, 80), (19, 3, 64), (300, 4, 64)]


# ------------------------------------------------------------------------------ reference vs spec


def hadamard_case(mix_target: torch.Tensor, dim: int = 4):
    """x = ±1 Hadamard streams (mean x² = 1) and fn chosen so that x̂·fnᵀ·ρ equals mix_target."""
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    x = torch.kron(h2, h2)[:, :dim].reshape(1, 4, dim)  # 4 streams, linearly independent
    flat = x.reshape(-1)
    rho = 1.0 / math.sqrt(1.0 + 1e-6)
    fn = mix_target[:, None] * flat[None, :] / (flat.square().sum() * rho)
    return x, fn


def test_ref_matches_spec_18_2_sinkhorn_vector():
    """§18.2: μ = 2·sin(arange(24)), scale = [1, 0.5, 2], base = 0, 20 iterations."""
    x, fn = hadamard_case(2.0 * torch.sin(torch.arange(24.0)))
    post, comb, u = mhc.mhc_pre_ref(x, fn, torch.zeros(24), torch.tensor([1.0, 0.5, 2.0]), **EPS)
    pre = (u[0] @ x[0].T) / 4.0  # streams are orthogonal with |x_k|² = 4
    expect_pre = torch.tensor([0.500001, 0.843295, 0.860398, 0.570096])
    expect_post = torch.tensor([0.638682, 0.554187, 0.861194, 1.317166])
    expect_comb = torch.tensor([[0.713589, 0.266698, 0.014651, 0.001034],
                                [0.000205, 0.035325, 0.870266, 0.097287],
                                [0.037894, 0.009638, 0.056244, 0.900776],
                                [0.248311, 0.688339, 0.058838, 0.000902]])
    torch.testing.assert_close(pre, expect_pre, atol=2e-6, rtol=0)
    torch.testing.assert_close(post[0], expect_post, atol=2e-6, rtol=0)
    torch.testing.assert_close(comb[0], expect_comb, atol=2e-6, rtol=0)
    torch.testing.assert_close(comb[0].sum(0), torch.full((4,), 0.999999), atol=1e-6, rtol=0)
    torch.testing.assert_close(comb[0].sum(1), torch.tensor([0.99597, 1.00308, 1.00455, 0.99639]), atol=1e-5, rtol=0)


def test_ref_at_init_doubles_the_embedding():
    """§18.2: fn ≈ 0, base 0, scale 1 -> pre ≈ 0.5, post ≈ 1, comb ≈ 1/4, u ≈ 2·e for equal streams."""
    e = torch.randn(3, 1, 32).expand(3, 4, 32)
    fn = torch.randn(24, 128) * 1e-9
    post, comb, u = mhc.mhc_pre_ref(e, fn, torch.zeros(24), torch.ones(3), **EPS)
    torch.testing.assert_close(post, torch.ones(3, 4), atol=1e-6, rtol=0)
    torch.testing.assert_close(comb, torch.full((3, 4, 4), 0.25), atol=1e-5, rtol=0)
    torch.testing.assert_close(u, 2.0 * e[:, 0], atol=1e-5, rtol=1e-5)


def test_ref_post_sums_over_first_comb_index():
    """§6.3: X'[k] = post_k·f + Σ_j comb[j, k]·X[j]; comb is not symmetric, so the direction shows."""
    f, x, post, comb = prev_site(2, 4, 8, torch.float32, seed=3)
    out = mhc.mhc_post_ref(f, x, post, comb)
    for k in range(4):
        want = post[:, k, None] * f + sum(comb[:, j, k, None] * x[:, j] for j in range(4))
        torch.testing.assert_close(out[:, k], want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_is_the_model_torch_path_bit_for_bit(dtype):
    """The references compute what the model's own torch functions (deepseek_v4/mhc.py) compute, op
    for op: a model wired through the registry on CPU gives the same bits as one calling `hc_pre`/
    `hc_post`, and `mhc_post_pre_ref` is exactly `mhc_post_ref` then `mhc_pre_ref`."""
    f, x, post, comb = prev_site(5, 4, 48, dtype, seed=2)
    fn, base, scale = site_params(4, 48, seed=4)
    u, want_post, want_comb = hc_pre(x, fn, base, scale, 4, EPS["sinkhorn_iters"], EPS["hc_eps"], EPS["rms_eps"])
    for out, want in zip(mhc.mhc_pre_ref(x, fn, base, scale, **EPS), (want_post, want_comb, u)):
        assert out.dtype == want.dtype and torch.equal(out, want)
    y = mhc.mhc_post_ref(f, x, post, comb)
    assert torch.equal(y, hc_post(f, x, post, comb))
    fused = mhc.mhc_post_pre_ref(f, x, post, comb, fn, base, scale, **EPS)
    for out, want in zip(fused, (y, *mhc.mhc_pre_ref(y, fn, base, scale, **EPS))):
        assert torch.equal(out, want)


@pytest.mark.parametrize("bad", ["x", "fn", "base", "scale", "fn_dtype", "iters"])
def test_pre_rejects_bad_arguments(bad):
    x = torch.randn(2, 4, 8)
    fn, base, scale = torch.randn(24, 32), torch.randn(24), torch.rand(3)
    kwargs = dict(EPS)
    if bad == "x":
        x = x[0]
    elif bad == "fn":
        fn = fn[:, :16]
    elif bad == "base":
        base = base[:8]
    elif bad == "scale":
        scale = scale[:1]
    elif bad == "fn_dtype":
        fn = fn.double()
    else:
        kwargs["sinkhorn_iters"] = 0
    with pytest.raises(ValueError, match=bad.split("_")[0] if bad != "iters" else "sinkhorn_iters"):
        mhc.mhc_pre_ref(x, fn, base, scale, **kwargs)


@pytest.mark.parametrize("bad", ["f", "post", "comb"])
def test_post_rejects_bad_arguments(bad):
    f, x, post, comb = prev_site(2, 4, 8, torch.float32, seed=1)
    args = {"f": f, "post": post, "comb": comb}
    args[bad] = args[bad][..., :-1]
    with pytest.raises(ValueError, match=bad):
        mhc.mhc_post_ref(args["f"], x, args["post"], args["comb"])


# ------------------------------------------------------------------------------- fused vs reference


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tok,n_hc,dim", SHAPES)
def test_pre_fused_matches_ref(n_tok, n_hc, dim, dtype, poisoned):
    x = streams(n_tok, n_hc, dim, dtype, seed=n_tok)
    params = site_params(n_hc, dim, seed=dim)
    with poisoned():
        post, comb, u = mhc.mhc_pre(x, *params, **EPS)
    ref = mhc.mhc_pre_ref(x, *params, **EPS)
    assert u.dtype == x.dtype and post.dtype == comb.dtype == torch.float32
    for out, want in zip((post, comb, u), ref):
        assert out.shape == want.shape
        assert rel_err(out, want) < TOL[dtype]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tok,n_hc,dim", SHAPES[1:])
def test_post_fused_matches_ref(n_tok, n_hc, dim, dtype, poisoned):
    f, x, post, comb = prev_site(n_tok, n_hc, dim, dtype, seed=7)
    with poisoned():
        out = mhc.mhc_post(f, x, post, comb)
    assert out.dtype == x.dtype
    assert rel_err(out, mhc.mhc_post_ref(f, x, post, comb)) < TOL[dtype]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tok,n_hc,dim", SHAPES)
def test_post_pre_fused_matches_ref(n_tok, n_hc, dim, dtype, poisoned):
    f, x, post, comb = prev_site(n_tok, n_hc, dim, dtype, seed=11)
    params = site_params(n_hc, dim, seed=12)
    with poisoned():
        fused = mhc.mhc_post_pre(f, x, post, comb, *params, **EPS)
    ref = mhc.mhc_post_pre_ref(f, x, post, comb, *params, **EPS)
    for out, want in zip(fused, ref):
        assert out.shape == want.shape and out.dtype == want.dtype
        assert rel_err(out, want) < TOL[dtype]


@needs_triton
@pytest.mark.parametrize("n_tok,n_hc,dim", [(1, 4, 1100), (3, 4, 256), (4, 3, 200), (12, 4, 256)])
def test_few_tokens_split_the_streams_over_programs(n_tok, n_hc, dim, monkeypatch, poisoned):
    """Up to SPLIT_STREAMS_MAX_TOKENS tokens each statistics program takes one stream of one split
    (HC × splits partials, here several D-splits of several D-blocks each, with the SM count raised),
    and the epilogue reduces them in one round: pre and post+pre equal the references, and the
    partials are HC × as many as the unsplit pass writes."""
    monkeypatch.setattr(mhc, "_num_sms", lambda device: 16)
    assert n_tok <= mhc.SPLIT_STREAMS_MAX_TOKENS
    x = streams(n_tok, n_hc, dim, torch.float32, seed=n_tok)
    params = site_params(n_hc, dim, seed=dim)
    dpart, _ = mhc._launch_stats(x, params[0], n_hc, dim)
    splits = min(triton_cdiv(dim, 64), triton_cdiv(32, n_hc))
    assert dpart.shape[0] == splits * n_hc
    with poisoned():
        got = mhc.mhc_pre(x, *params, **EPS)
    for out, want in zip(got, mhc.mhc_pre_ref(x, *params, **EPS)):
        assert rel_err(out, want) < TOL[torch.float32]
    f, x, post, comb = prev_site(n_tok, n_hc, dim, torch.float32, seed=3)
    with poisoned():
        got = mhc.mhc_post_pre(f, x, post, comb, *params, **EPS)
    for out, want in zip(got, mhc.mhc_post_pre_ref(f, x, post, comb, *params, **EPS)):
        assert rel_err(out, want) < TOL[torch.float32]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@needs_triton
@pytest.mark.parametrize("n_tok,n_hc,dim,dtype", [(6, 4, 300, torch.bfloat16), (5, 3, 96, torch.float32),
                                                  (19, 4, 300, torch.float32), (21, 3, 64, torch.bfloat16)])
def test_mixes_launched_apart_give_the_same_bits(n_tok, n_hc, dim, dtype, poisoned, counted_lane):
    """With `mixes_on` the epilogue is two launches: u (ROLE 1, every D-block) on the caller's stream
    and post and comb (ROLE 2: one program per token block, no x tile) under `mixes_on()` (the static
    step's side stream), for the one-token blocks of the stream split and the 4-token blocks past it:
    every output equals the one-launch epilogue's bit for bit, both ops, with the models' 4 streams
    (3 padded streams: post within 4 ulp, as `test_mhc_norm`'s row epilogue)."""
    x = streams(n_tok, n_hc, dim, dtype, seed=n_tok)
    params = site_params(n_hc, dim, seed=dim)
    f, x_prev, post, comb = prev_site(n_tok, n_hc, dim, dtype, seed=4)
    for op, args in ((mhc.mhc_pre, (x, *params)), (mhc.mhc_post_pre, (f, x_prev, post, comb, *params))):
        whole = op(*args, **EPS)
        with poisoned():
            apart = op(*args, **EPS, mixes_on=counted_lane)
        for i, (a, b) in enumerate(zip(whole, apart)):
            if n_hc != 4 and a is whole[-3]:  # post
                torch.testing.assert_close(b, a, rtol=4.8e-7, atol=0)  # 4 ulp of fp32 near 1
            else:
                assert torch.equal(a, b), i
        ref = (mhc.mhc_pre_ref if op is mhc.mhc_pre else mhc.mhc_post_pre_ref)(*args, **EPS, mixes_on=counted_lane)
        assert all(rel_err(a, b) < TOL[dtype] for a, b in zip(apart, ref))
    assert counted_lane.entered == 2  # one mixes launch per fused op; the references never enter it


@needs_triton
def test_pre_fused_matches_spec_18_2_vector():
    x, fn = hadamard_case(2.0 * torch.sin(torch.arange(24.0)), dim=4)
    args = (x.to(DEVICE), fn.to(DEVICE), torch.zeros(24, device=DEVICE), torch.tensor([1.0, 0.5, 2.0], device=DEVICE))
    for out, want in zip(mhc.mhc_pre(*args, **EPS), mhc.mhc_pre_ref(*args, **EPS)):
        torch.testing.assert_close(out, want, atol=2e-6, rtol=0)


# ----------------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 64, 4096])
@pytest.mark.parametrize("dim", [2048, 4096])
def test_real_shapes_on_gpu(n_tok, dim):
    x = streams(n_tok, 4, dim, torch.bfloat16, seed=0)
    params = site_params(4, dim, seed=1)
    for out, want in zip(mhc.mhc_pre(x, *params, **EPS), mhc.mhc_pre_ref(x, *params, **EPS)):
        assert rel_err(out, want) < TOL[torch.bfloat16]
    f, x, post, comb = prev_site(n_tok, 4, dim, torch.bfloat16, seed=2)
    fused = mhc.mhc_post_pre(f, x, post, comb, *params, **EPS)
    for out, want in zip(fused, mhc.mhc_post_pre_ref(f, x, post, comb, *params, **EPS)):
        assert rel_err(out, want) < TOL[torch.bfloat16]
    assert rel_err(mhc.mhc_post(f, x, post, comb), mhc.mhc_post_ref(f, x, post, comb)) < TOL[torch.bfloat16]
