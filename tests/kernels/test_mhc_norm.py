"""V4 mHC sites with the sublayer RMSNorm folded in (dspark/kernels/mhc_norm.py): the references are
the block's former torch order bit for bit; the fused ops match the unfused Triton pair (mhc_pre /
mhc_post_pre, then rms_norm) within rms_norm's tolerance, and the references within mHC's.

On CPU the kernels run under the interpreter (conftest.py) on tiny shapes that cross the block
edges: N = 1..4 (one token per row block, the decode tiles; D = 1100: two D-blocks of 1024 on two
programs), N = 5 and 19 (4-token blocks, a partial one; D = 600: 3 D-blocks over 2 programs, so one
program stores two and the other one a block past the end, masked), D not a multiple of the D tile,
N = 300 (prefill tiles, one program per token block; post+pre only: slow under the interpreter); n_hc = 3 (padded to 4).
"""

import pytest
import torch

from dspark.kernels import KernelConfig, mhc, mhc_norm, norm_folded_op, rms_norm, triton_available
from dspark.models.deepseek_v4.norm import RMSNorm

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MHC_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # ‖Δ‖/‖ref‖ vs the references, as test_mhc.py
NORM_TOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7}  # vs the unfused Triton pair: test_kernels_norm_rope.py
EPS = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
NORM_EPS = 1e-6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in output: an element was not written"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest element error relative to the tensor's scale (max |ref|): an element-wise ratio
    would blow up where u nearly cancels, and FMA contraction differs between the fused epilogue and
    the unfused mhc_pre on the GPU (fp32: 1.7e-5 element-wise at 6.8e-8 norm-wise on the H200)."""
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def site(n_tok: int, n_hc: int, dim: int, dtype: torch.dtype, seed: int):
    """Streams x [N, H, D], a site's (fn, base, scale) with base ~ N(0, 0.5), scale ~ U(0.5, 1.5),
    and a norm weight U(0.5, 1.5) [D]."""
    g = torch.Generator().manual_seed(seed)
    n_mix = (2 + n_hc) * n_hc
    x = torch.randn(n_tok, n_hc, dim, generator=g).to(dtype)
    params = (torch.randn(n_mix, n_hc * dim, generator=g) * 0.05, torch.randn(n_mix, generator=g) * 0.5,
              torch.rand(3, generator=g) + 0.5)
    weight = torch.rand(dim, generator=g) + 0.5
    return x.to(DEVICE), [p.to(DEVICE) for p in params], weight.to(DEVICE)


def finished(n_tok: int, n_hc: int, dim: int, dtype: torch.dtype, seed: int):
    """A sublayer output f [N, D] and the (post, comb) of the site that ran it, on streams x."""
    x, params, _ = site(n_tok, n_hc, dim, dtype, seed)
    post, comb, _ = mhc.mhc_pre_ref(x, *params, **EPS)
    f = torch.randn(n_tok, dim, generator=torch.Generator().manual_seed(seed + 1)).to(device=DEVICE, dtype=dtype)
    return f, x, post, comb


SHAPES = [(1, 4, 256), (2, 4, 1100), (4, 3, 80), (5, 4, 600), (19, 3, 64)]  # (N, n_hc, D)


# ---------------------------------------------------------------------- reference vs the model path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_is_the_block_torch_order_bit_for_bit(dtype):
    """mhc_pre_ref then the RMSNorm module (its reference), and mhc_post_pre_ref then it: what a V4
    block computed before the fold, exactly."""
    x, params, weight = site(6, 4, 48, dtype, seed=1)
    norm = RMSNorm(48, NORM_EPS, device=DEVICE)
    norm.weight.data.copy_(weight)
    post, comb, u = mhc.mhc_pre_ref(x, *params, **EPS)
    out = mhc_norm.mhc_pre_norm_ref(x, *params, weight, **EPS, norm_eps=NORM_EPS)
    for got, want in zip(out, (post, comb, norm(u))):
        assert got.dtype == want.dtype and torch.equal(got, want)

    f = torch.randn(6, 48).to(device=DEVICE, dtype=dtype)
    x_new, post2, comb2, u2 = mhc.mhc_post_pre_ref(f, x, post, comb, *params, **EPS)
    out = mhc_norm.mhc_post_pre_norm_ref(f, x, post, comb, *params, weight, **EPS, norm_eps=NORM_EPS)
    for got, want in zip(out, (x_new, post2, comb2, norm(u2))):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("op", ["mhc_pre_norm_ref", "mhc_post_pre_norm_ref"])
def test_rejects_a_bad_norm_weight(op):
    f, x, post, comb = finished(2, 4, 8, torch.float32, seed=3)
    _, params, weight = site(2, 4, 8, torch.float32, seed=4)
    lead = (x,) if op == "mhc_pre_norm_ref" else (f, x, post, comb)
    with pytest.raises(ValueError, match="norm_weight"):
        getattr(mhc_norm, op)(*lead, *params, weight[:4], **EPS, norm_eps=NORM_EPS)


def test_norm_folded_op_at_ref_is_the_reference_pair():
    """`norm_folded_op` with the op at "ref" runs the site op, then `rms_norm`, as the config picks them:
    with everything on the references that is the op's reference, bit for bit."""
    x, params, weight = site(3, 4, 32, torch.float32, seed=8)
    site_then_norm = norm_folded_op(KernelConfig(), "mhc_pre_norm")
    want = mhc_norm.mhc_pre_norm_ref(x, *params, weight, **EPS, norm_eps=NORM_EPS)
    for got, ref in zip(site_then_norm(x, *params, weight, **EPS, norm_eps=NORM_EPS), want):
        assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="mhc_pre"):
        norm_folded_op(KernelConfig(), "mhc_pre")


@needs_triton
def test_norm_folded_op_keeps_the_other_ops_choice():
    """Op on: the fused kernel. Op at "ref" beside Triton site and norm ops: those two kernels, exactly."""
    config = KernelConfig.uniform("triton")
    assert norm_folded_op(config, "mhc_post_pre_norm") is mhc_norm.mhc_post_pre_norm
    x, params, weight = site(2, 4, 40, torch.float32, seed=10)
    unfused = norm_folded_op(KernelConfig(**dict(vars(config), mhc_pre_norm="ref")), "mhc_pre_norm")
    for got, want in zip(unfused(x, *params, weight, **EPS, norm_eps=NORM_EPS), unfused_pre(x, params, weight)):
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------- fused vs unfused


def unfused_pre(x, params, weight):
    """The path the fold replaces, in Triton: mhc_pre, then the rms_norm kernel on u."""
    post, comb, u = mhc.mhc_pre(x, *params, **EPS)
    return post, comb, rms_norm.rms_norm(u, weight, eps=NORM_EPS, out_dtype=u.dtype)


def assert_matches(fused, unfused, ref, dtype):
    """Mixes as the unfused kernels (same statistics kernel and mixes code), the normed input within
    rms_norm's tolerance of the unfused kernel, everything within mHC's tolerance of the reference."""
    *mixes, h = fused
    *want_mixes, want_h = unfused
    for got, want in zip(mixes, want_mixes):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert h.shape == want_h.shape and h.dtype == want_h.dtype == dtype
    assert rel_err(h, want_h) < NORM_TOL[dtype] and max_rel(h, want_h) <= 4 * NORM_TOL[dtype]
    for got, want in zip(fused, ref):
        assert rel_err(got, want) < MHC_TOL[dtype]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tok,n_hc,dim", SHAPES)
def test_pre_norm_matches_the_unfused_kernels(n_tok, n_hc, dim, dtype, poisoned, monkeypatch):
    monkeypatch.setattr(mhc_norm, "FOLD_MAX_TOKENS", 1 << 30)  # the fused epilogue at every N (its 4-token tiles)
    x, params, weight = site(n_tok, n_hc, dim, dtype, seed=n_tok + dim)
    with poisoned():
        fused = mhc_norm.mhc_pre_norm(x, *params, weight, **EPS, norm_eps=NORM_EPS)
    assert_matches(fused, unfused_pre(x, params, weight),
                   mhc_norm.mhc_pre_norm_ref(x, *params, weight, **EPS, norm_eps=NORM_EPS), dtype)


@needs_triton
@pytest.mark.parametrize("dtype,n_tok,n_hc,dim", [(dtype, *shape) for dtype in (torch.float32, torch.bfloat16)
                                                  for shape in SHAPES] + [(torch.bfloat16, 300, 4, 64)])
def test_post_pre_norm_matches_the_unfused_kernels(n_tok, n_hc, dim, dtype, poisoned, monkeypatch):
    monkeypatch.setattr(mhc_norm, "FOLD_MAX_TOKENS", 1 << 30)
    f, x, post, comb = finished(n_tok, n_hc, dim, dtype, seed=5)
    _, params, weight = site(n_tok, n_hc, dim, dtype, seed=6)
    with poisoned():
        fused = mhc_norm.mhc_post_pre_norm(f, x, post, comb, *params, weight, **EPS, norm_eps=NORM_EPS)
    x_new, post2, comb2, u2 = mhc.mhc_post_pre(f, x, post, comb, *params, **EPS)
    assert torch.equal(fused[0], x_new)  # the same statistics kernel writes X'
    unfused = (x_new, post2, comb2, rms_norm.rms_norm(u2, weight, eps=NORM_EPS, out_dtype=u2.dtype))
    ref = mhc_norm.mhc_post_pre_norm_ref(f, x, post, comb, *params, weight, **EPS, norm_eps=NORM_EPS)
    assert_matches(fused, unfused, ref, dtype)


@needs_triton
@pytest.mark.parametrize("n_tok,n_hc,dim,dtype", [(1, 4, 256, torch.bfloat16), (3, 3, 1100, torch.float32),
                                                  (4, 4, 80, torch.bfloat16), (6, 4, 64, torch.float32)])
def test_mixes_launched_apart_give_the_same_bits(n_tok, n_hc, dim, dtype, poisoned, counted_lane):
    """With `mixes_on` the row epilogue (up to FOLD_MAX_TOKENS tokens) is two launches, the collapse
    and norm (ROLE 1) on the caller's stream and post and comb (ROLE 2: partials, sigmoids, Sinkhorn)
    under `mixes_on()` (the static step's side stream): every output equals the one-launch epilogue's
    bit for bit at both sites with the models' 4 streams. With 3 (padded to 4) the H100 compiled post
    (2·σ) apart 1-3 ulp off in a few elements (comb and h equal; twenty-ninth and thirtieth sessions),
    so there post is held to 4 ulp. Past the fold (6 tokens) the unfused pair splits its epilogue the same way
    (`test_mhc.py`)."""
    x, params, weight = site(n_tok, n_hc, dim, dtype, seed=n_tok + 11)
    f, _, post, comb = finished(n_tok, n_hc, dim, dtype, seed=12)
    for op, args in ((mhc_norm.mhc_pre_norm, (x, *params, weight)),
                     (mhc_norm.mhc_post_pre_norm, (f, x, post, comb, *params, weight))):
        whole = op(*args, **EPS, norm_eps=NORM_EPS)
        with poisoned():
            apart = op(*args, **EPS, norm_eps=NORM_EPS, mixes_on=counted_lane)
        assert len(whole) == len(apart)
        for i, (a, b) in enumerate(zip(whole, apart)):
            if n_hc != 4 and a is whole[-3]:  # post
                torch.testing.assert_close(b, a, rtol=4.8e-7, atol=0)  # 4 ulp of fp32 near 1
            else:
                assert torch.equal(a, b), i
        ref = (mhc_norm.mhc_pre_norm_ref if op is mhc_norm.mhc_pre_norm else mhc_norm.mhc_post_pre_norm_ref)(
            *args, **EPS, norm_eps=NORM_EPS, mixes_on=counted_lane)  # the reference takes it and runs in order
        assert all(rel_err(a, b) < MHC_TOL[dtype] for a, b in zip(apart, ref))
    assert counted_lane.entered == 2  # one mixes launch per fused op, folded or not


@needs_triton
@pytest.mark.parametrize("n_tok,n_hc,dim,dtype", [(7, 3, 200, torch.float32)])
def test_the_row_epilogue_past_four_rows(n_tok, n_hc, dim, dtype, poisoned, counted_lane):
    """Past 4 rows (up to ROW_MAX_TOKENS) both folded ops take the row epilogue, one token per program
    row, in one launch and with the mixes apart, and match the unfused kernels."""
    assert mhc_norm.folds(n_tok, dim) and mhc_norm.row_tiles(n_tok, dim) is not None
    x, params, weight = site(n_tok, n_hc, dim, dtype, seed=n_tok)
    f, _, post, comb = finished(n_tok, n_hc, dim, dtype, seed=3)
    x_new, *_ = mhc.mhc_post_pre(f, x, post, comb, *params, **EPS)
    for mixes_on in (None, counted_lane):
        with poisoned():
            fused = mhc_norm.mhc_pre_norm(x, *params, weight, **EPS, norm_eps=NORM_EPS, mixes_on=mixes_on)
            fused_pp = mhc_norm.mhc_post_pre_norm(f, x, post, comb, *params, weight, **EPS, norm_eps=NORM_EPS,
                                                  mixes_on=mixes_on)
        assert_matches(fused, unfused_pre(x, params, weight),
                       mhc_norm.mhc_pre_norm_ref(x, *params, weight, **EPS, norm_eps=NORM_EPS), dtype)
        assert torch.equal(fused_pp[0], x_new)
        assert_matches(fused_pp[1:], unfused_pre(x_new, params, weight),
                       mhc_norm.mhc_post_pre_norm_ref(f, x, post, comb, *params, weight, **EPS,
                                                      norm_eps=NORM_EPS)[1:], dtype)
    assert counted_lane.entered == 2


@needs_triton
def test_every_epilogue_program_walks_the_whole_row(monkeypatch):
    """Σu² is over the full row whatever share of it a program stores: a norm taken over one D-block
    only would be far off at D = 1000 (4 D-blocks of 256 here, 4 programs at N = 3 on CPU)."""
    x, params, weight = site(3, 4, 1000, torch.float32, seed=9)
    monkeypatch.setattr(mhc_norm, "row_tiles", lambda n, d: None)  # the walks, not the row in registers
    monkeypatch.setattr(mhc_norm, "_norm_tiles", lambda n, d: (1, 256))
    h = mhc_norm.mhc_pre_norm(x, *params, weight, **EPS, norm_eps=NORM_EPS)[2]
    want = mhc_norm.mhc_pre_norm_ref(x, *params, weight, **EPS, norm_eps=NORM_EPS)[2]
    assert rel_err(h, want) < MHC_TOL[torch.float32]


# ----------------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [1, 4, 8, 64, 4096])
@pytest.mark.parametrize("dim", [2048, 4096, 7168])
def test_real_shapes_on_gpu(n_tok, dim):
    dtype = torch.bfloat16
    x, params, weight = site(n_tok, 4, dim, dtype, seed=0)
    fused = mhc_norm.mhc_pre_norm(x, *params, weight, **EPS, norm_eps=NORM_EPS)
    assert_matches(fused, unfused_pre(x, params, weight),
                   mhc_norm.mhc_pre_norm_ref(x, *params, weight, **EPS, norm_eps=NORM_EPS), dtype)
    f, x, post, comb = finished(n_tok, 4, dim, dtype, seed=2)
    fused = mhc_norm.mhc_post_pre_norm(f, x, post, comb, *params, weight, **EPS, norm_eps=NORM_EPS)
    x_new, post2, comb2, u2 = mhc.mhc_post_pre(f, x, post, comb, *params, **EPS)
    assert torch.equal(fused[0], x_new)
    unfused = (x_new, post2, comb2, rms_norm.rms_norm(u2, weight, eps=NORM_EPS, out_dtype=u2.dtype))
    assert_matches(fused, unfused,
                   mhc_norm.mhc_post_pre_norm_ref(f, x, post, comb, *params, weight, **EPS, norm_eps=NORM_EPS), dtype)


@needs_triton
def test_above_the_fold_limit_the_ops_run_the_unfused_pair(monkeypatch):
    """Above ROW_MAX_TOKENS both ops are the unfused Triton pair, bit for bit, and the fused epilogue
    does not launch."""
    launches = []
    kernel = mhc_norm._mhc_norm_epilogue_kernel
    monkeypatch.setattr(mhc_norm, "_mhc_norm_epilogue_kernel",
                        type("Count", (), {"__getitem__": lambda self, grid: launches.append(grid) or kernel[grid]})())
    n_tok = mhc_norm.ROW_MAX_TOKENS + 1
    assert not mhc_norm.folds(n_tok, 256)
    x, params, weight = site(n_tok, 4, 256, torch.bfloat16, seed=2)
    got = mhc_norm.mhc_pre_norm(x, *params, weight, **EPS, norm_eps=NORM_EPS)
    post, comb, u = mhc.mhc_pre(x, *params, **EPS)
    for a, b in zip(got, (post, comb, rms_norm.rms_norm(u, weight, eps=NORM_EPS, out_dtype=u.dtype))):
        assert torch.equal(a, b)
    f, x2, post0, comb0 = finished(n_tok, 4, 256, torch.bfloat16, seed=3)
    got = mhc_norm.mhc_post_pre_norm(f, x2, post0, comb0, *params, weight, **EPS, norm_eps=NORM_EPS)
    *want, u2 = mhc.mhc_post_pre(f, x2, post0, comb0, *params, **EPS)
    for a, b in zip(got, (*want, rms_norm.rms_norm(u2, weight, eps=NORM_EPS, out_dtype=u2.dtype))):
        assert torch.equal(a, b)
    assert not launches
    mhc_norm.mhc_pre_norm(x[:1], *params, weight, **EPS, norm_eps=NORM_EPS)
    assert len(launches) == 1


def test_wide_rows_fold_only_where_the_walk_was_measured_faster():
    """The row epilogue (up to ROW_MAX_TOKENS rows) holds rows up to ROW_MAX wide; wider ones (V4-Pro's
    7168) walk the row and fold only up to FOLD_MAX_TOKENS tokens, where that walk won."""
    assert mhc_norm.ROW_MAX_TOKENS > mhc_norm.FOLD_MAX_TOKENS
    for n_tok in (1, mhc_norm.FOLD_MAX_TOKENS, mhc_norm.ROW_MAX_TOKENS):
        assert mhc_norm.folds(n_tok, mhc_norm.ROW_MAX)
    assert mhc_norm.folds(mhc_norm.FOLD_MAX_TOKENS, 7168)
    assert not mhc_norm.folds(mhc_norm.FOLD_MAX_TOKENS + 1, 7168)
    assert not mhc_norm.folds(mhc_norm.ROW_MAX_TOKENS + 1, mhc_norm.ROW_MAX)
