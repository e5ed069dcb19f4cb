"""V4's output collapse with the final RMSNorm folded in (dspark/kernels/hc_head_norm.py): the reference
is the model's former torch order bit for bit; the Triton op matches it within mHC's tolerances.

On CPU the kernels run under the interpreter (conftest.py) on tiny shapes that cross the block
edges: N = 1..4 (decode tiles, one token per row block; D = 1100: two D-blocks of 1024 on two
programs), N = 5 and 19 (4-token blocks, a partial one; D = 600: 3 D-blocks over 2 programs, one
of them masked past the end), D not a multiple of the tile, n_hc = 3 (padded to 4).
"""

import pytest
import torch

from dspark.kernels import KernelConfig, get_op, hc_head_norm, head_norm_op, mhc_norm, rms_norm, triton_available
from dspark.models.deepseek_v4.mhc import hc_head
from dspark.models.deepseek_v4.norm import RMSNorm

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MHC_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # ‖Δ‖/‖ref‖ vs the references, as test_mhc.py
EPS = dict(rms_eps=1e-6, hc_eps=1e-6, norm_eps=1e-5)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in output: an element was not written"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest element error relative to the tensor's scale (max |ref|), as test_mhc_norm.py."""
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def head(n_tok: int, n_hc: int, dim: int, dtype: torch.dtype, seed: int):
    """Streams x [N, H, D], the head's (fn [H, H·D], base [H] ~ N(0, 0.5), scale [1] ~ U(0.5, 1.5)) and
    a norm weight U(0.5, 1.5) [D]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, n_hc, dim, generator=g).to(dtype)
    params = (torch.randn(n_hc, n_hc * dim, generator=g) * 0.05, torch.randn(n_hc, generator=g) * 0.5,
              torch.rand(1, generator=g) + 0.5)
    weight = torch.rand(dim, generator=g) + 0.5
    return x.to(DEVICE), [p.to(DEVICE) for p in params], weight.to(DEVICE)


SHAPES = [(1, 4, 256), (2, 4, 1100), (4, 3, 80), (5, 4, 600), (19, 3, 64)]  # (N, n_hc, D)


# ---------------------------------------------------------------------- reference vs the model path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_is_the_model_torch_order_bit_for_bit(dtype):
    """hc_head then the RMSNorm module (its reference): what the V4 model computed before the fold."""
    x, params, weight = head(6, 4, 48, dtype, seed=1)
    norm = RMSNorm(48, EPS["norm_eps"], device=DEVICE)
    norm.weight.data.copy_(weight)
    want = norm(hc_head(x, *params, EPS["hc_eps"], EPS["rms_eps"]))
    got = hc_head_norm.hc_head_norm_ref(x, *params, weight, **EPS)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("bad", ["fn", "base", "scale", "norm_weight", "x"])
def test_rejects_bad_arguments(bad):
    x, (fn, base, scale), weight = head(2, 4, 8, torch.float32, seed=3)
    args = dict(x=x, fn=fn, base=base, scale=scale, norm_weight=weight)
    args[bad] = {"fn": fn[:, :8], "base": base[:2], "scale": torch.ones(3), "norm_weight": weight[:4],
                 "x": x[0]}[bad]
    with pytest.raises(ValueError, match=bad):
        hc_head_norm.hc_head_norm_ref(*args.values(), **EPS)
    with pytest.raises(ValueError, match="float32"):
        hc_head_norm.hc_head_norm_ref(x, fn.double(), base, scale, weight, **EPS)


def test_head_norm_op_at_ref_is_the_reference_pair():
    """`head_norm_op` with the op at "ref" and the norm at "ref": the op's reference, bit for bit."""
    x, params, weight = head(3, 4, 32, torch.float32, seed=8)
    got = head_norm_op(KernelConfig())(x, *params, weight, **EPS)
    assert torch.equal(got, hc_head_norm.hc_head_norm_ref(x, *params, weight, **EPS))


@needs_triton
def test_head_norm_op_keeps_the_norm_choice():
    """Op on: the fused kernel. Op at "ref" beside a Triton rms_norm: hc_head, then that kernel, exactly."""
    config = KernelConfig.uniform("triton")
    assert head_norm_op(config) is get_op(config, "hc_head_norm") is hc_head_norm.hc_head_norm
    x, params, weight = head(2, 4, 40, torch.float32, seed=10)
    unfused = head_norm_op(KernelConfig(**dict(vars(config), hc_head_norm="ref")))
    u = hc_head(x, *params, EPS["hc_eps"], EPS["rms_eps"])
    assert torch.equal(unfused(x, *params, weight, **EPS),
                       rms_norm.rms_norm(u, weight, eps=EPS["norm_eps"], out_dtype=u.dtype))


# ---------------------------------------------------------------------------------- fused vs ref


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_tok,n_hc,dim", SHAPES)
def test_fused_matches_the_reference(n_tok, n_hc, dim, dtype, poisoned):
    x, params, weight = head(n_tok, n_hc, dim, dtype, seed=n_tok + dim)
    with poisoned():
        got = hc_head_norm.hc_head_norm(x, *params, weight, **EPS)
    want = hc_head_norm.hc_head_norm_ref(x, *params, weight, **EPS)
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    assert rel_err(got, want) < MHC_TOL[dtype] and max_rel(got, want) <= 4 * MHC_TOL[dtype]


@needs_triton
def test_every_epilogue_program_walks_the_whole_row(monkeypatch):
    """Σu² is over the full row whatever share of it a program stores: a norm taken over one D-block
    only would be far off at D = 1000 (4 D-blocks of 256 here, 4 programs at N = 3 on CPU)."""
    x, params, weight = head(3, 4, 1000, torch.float32, seed=9)
    monkeypatch.setattr(mhc_norm, "_norm_tiles", lambda n, d: (1, 256))
    got = hc_head_norm.hc_head_norm(x, *params, weight, **EPS)
    assert rel_err(got, hc_head_norm.hc_head_norm_ref(x, *params, weight, **EPS)) < MHC_TOL[torch.float32]


@needs_triton
def test_runs_the_reference_while_autograd_records():
    """No backward in the kernel: with a parameter requiring grad the op is the reference (a gradient flows)."""
    x, (fn, base, scale), weight = head(2, 4, 32, torch.float32, seed=11)
    fn.requires_grad_(True)
    got = hc_head_norm.hc_head_norm(x, fn, base, scale, weight, **EPS)
    want = hc_head_norm.hc_head_norm_ref(x, fn, base, scale, weight, **EPS)
    assert got.grad_fn is not None and torch.equal(got, want)
    got.sum().backward()
    assert fn.grad is not None and fn.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_tok", [1, 4, 8, 64, 4096])
@pytest.mark.parametrize("dim", [2048, 4096, 7168])
def test_real_shapes_on_gpu(n_tok, dim, dtype):
    x, params, weight = head(n_tok, 4, dim, dtype, seed=0)
    got = hc_head_norm.hc_head_norm(x, *params, weight, **EPS)
    want = hc_head_norm.hc_head_norm_ref(x, *params, weight, **EPS)
    assert got.dtype == want.dtype == dtype
    assert rel_err(got, want) < MHC_TOL[dtype] and max_rel(got, want) <= 4 * MHC_TOL[dtype]
    # the collapse itself (pre, then u) as the torch path rounds it: h is within a bf16 / fp32 rounding of
    # the Triton rms_norm of the torch u (catches a wrong pre that the loose bf16 bound might let pass)
    u = hc_head(x, *params, EPS["hc_eps"], EPS["rms_eps"])
    unfused = rms_norm.rms_norm(u, weight, eps=EPS["norm_eps"], out_dtype=u.dtype)
    assert rel_err(got, unfused) < {torch.bfloat16: 2 ** -7, torch.float32: 1e-5}[dtype]
