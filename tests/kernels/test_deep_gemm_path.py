"""The optional deep_gemm linear (dspark/kernels/deep_gemm_path.py) on CPU.

No deep_gemm build runs here or on the GPU image, so: without deep_gemm the op must fall back to the
op it replaces bit for bit and say why; with the test double of `deep_gemm_double.py` injected as the
`deep_gemm` module (and the Hopper check answered yes), the wrappers must hand the library the layouts
its contract requires and reproduce a W8A8 torch reference.
"""

import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import deep_gemm_double
from deep_gemm_double import double  # noqa: F401 (the fixture)
from dspark import quant
from dspark.kernels import KernelConfig, get_op
from dspark.kernels import deep_gemm_path as dg
from dspark.kernels.fp8 import FP8BlockWeight
from dspark.kernels.linear import linear_ref
from dspark.models.deepseek_v4.linear import Linear


@pytest.fixture
def no_deep_gemm(monkeypatch):
    """deep_gemm absent, even where it is installed (None in sys.modules makes the import fail)."""
    monkeypatch.setitem(sys.modules, "deep_gemm", None)


def _data(m=6, n=192, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Columns of different magnitude, so the per-128-column activation scales differ within a row.
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-3, 4, (1, k), generator=g).float())
    return x.to(torch.bfloat16), (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_without_deep_gemm_the_op_is_the_reference_bit_for_bit(no_deep_gemm):
    x, w = _data()
    op = get_op(KernelConfig(linear="deep_gemm"), "linear")
    with pytest.warns(RuntimeWarning, match="linear='deep_gemm' falls back: deep_gemm does not import"):
        y = op(x, w)
    assert torch.equal(y, linear_ref(x, w))
    assert "does not import" in op.fallback_reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason: the second call is silent
        assert torch.equal(op(x[:1], w), linear_ref(x[:1], w))


def test_linear_module_with_deep_gemm_selected_matches_the_default(no_deep_gemm):
    torch.manual_seed(0)
    plain = Linear(256, 128, dtype=torch.bfloat16)
    chosen = Linear(256, 128, dtype=torch.bfloat16, kernels=KernelConfig(linear="deep_gemm"))
    chosen.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning):
        assert torch.equal(chosen(x), plain(x))
    with pytest.raises(ValueError, match="must match weight"):  # bad input still raises, as the op's would
        chosen(x[..., :100])


def test_available_names_each_missing_piece(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    ok, reason = dg.available("cuda")
    assert not ok and "does not import" in reason
    module = deep_gemm_double.make()
    monkeypatch.setitem(sys.modules, "deep_gemm", module)
    ok, reason = dg.available("cpu")
    assert not ok and "CUDA devices" in reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    ok, reason = dg.available("cuda:0")
    assert not ok and "9.x" in reason and "8.0" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert dg.available("cuda:0") == (True, "deep_gemm 2.1-double (current API)")
    monkeypatch.delattr(module, "m_grouped_fp8_gemm_nt_contiguous")
    ok, reason = dg.available("cuda:0")
    assert not ok and "m_grouped_fp8_gemm_nt_contiguous" in reason


def test_older_release_names_resolve(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", deep_gemm_double.make(legacy=True))
    api = dg.load_api()
    assert api.legacy and api.gemm_nt is sys.modules["deep_gemm"].gemm_fp8_fp8_bf16_nt and api.alignment() == 128


@pytest.mark.parametrize("m", [1, 5, 8])
def test_activation_layout_is_mn_major_tma_aligned(m):
    x, _ = _data(m=m)
    q, sfa = dg.quantize_activations(x)
    padded = (m + 3) // 4 * 4
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and sfa.dtype == torch.float32
    assert sfa.shape == (m, 2) and sfa.stride() == (1, padded)
    mantissa, _ = torch.frexp(sfa)
    assert bool((mantissa == 0.5).all())  # powers of two: UE8M0-exact
    deq = q.float() * sfa.repeat_interleave(128, dim=1)
    assert (deq - x.float()).abs().le(x.float().abs() * 2.0**-4 + 2.0**-9 * sfa.repeat_interleave(128, 1)).all()


def test_activation_scales_take_deepseeks_amax_floor():
    """Rows far below 1e-4 get the floor's scale (as `moe_w8a8` and DeepSeek's inference quantise), so
    they keep only what e4m3's subnormals hold; rows above it keep their own."""
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3)) * 1e-7
    x[1, :128] *= 3e7
    q, sf = dg.quantize_rows(x)
    floor = 2.0 ** math.ceil(math.log2(quant.ACTIVATION_AMAX_FLOOR / 448))
    own = 2.0 ** math.ceil(math.log2(x[1, :128].abs().max().item() / 448))
    assert sf.tolist() == [[floor, floor], [own, floor]]
    assert torch.equal(dg.dequantize_rows(q, sf), q.float() * sf.repeat_interleave(128, dim=1))


def test_wrapper_honours_the_contract_and_matches_w8a8_reference(double):
    x, w = _data()
    weight = dg.DeepGemmWeight.from_weight(w)
    y = dg.fp8_linear(dg.load_api(), x, weight)
    assert double.calls == ["gemm_nt"] and y.dtype == x.dtype and y.shape == (6, 192)
    torch.testing.assert_close(y, dg.w8a8_linear_ref(x, weight), rtol=2**-7, atol=1e-6)
    # W8A8 against the bf16 linear: fp8 error, not rounding (a numerics change, hence opt-in).
    assert 1e-2 < _rel(y, F.linear(x.float(), w.float())) < 0.06  # measured 0.038 (bf16: 0.0015)


def test_checkpoint_fp8_weights_convert_losslessly(double):
    _, w = _data()
    checkpoint = FP8BlockWeight.quantize(w.float(), 128)
    dense = checkpoint.dequantize(dtype=torch.bfloat16)  # what the loader gives the model
    from_dense, from_fp8 = dg.DeepGemmWeight.from_weight(dense), dg.DeepGemmWeight.from_weight(checkpoint)
    assert torch.equal(from_dense.dequantize(), from_fp8.dequantize())
    assert torch.equal(from_fp8.dequantize(), dense.float())
    with pytest.raises(ValueError, match="block 32"):
        dg.DeepGemmWeight.from_weight(FP8BlockWeight.quantize(w.float(), 32))


def test_op_runs_deep_gemm_and_converts_each_weight_once(double):
    x, w = _data(m=3)
    x = x.reshape(1, 3, -1)
    op = get_op(KernelConfig(linear="deep_gemm"), "linear")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no warning
        y = op(x, w)
        assert op.fallback_reason is None and double.calls == ["gemm_nt"] and y.shape == (1, 3, 192)
        converted = next(iter(op._weights.values()))
        op(x, w)
        assert next(iter(op._weights.values())) is converted
        w.mul_(2)  # in place (as load_state_dict does): converted again, the old copy dropped
        torch.testing.assert_close(op(x, w), 2 * y, rtol=0, atol=0)
        assert len(op._weights) == 1
        assert op(x[:, :0], w).shape == (1, 0, 192) and double.calls.count("gemm_nt") == 3


def test_op_falls_back_where_deep_gemm_cannot_run(double):
    op = get_op(KernelConfig(linear="deep_gemm"), "linear")
    x, w = _data(k=200)
    with pytest.warns(RuntimeWarning, match="K % 128 == 0"):
        assert torch.equal(op(x, w), linear_ref(x, w))
    x, w = _data()
    w.requires_grad_(True)
    with pytest.warns(RuntimeWarning, match="autograd"):
        assert torch.equal(op(x, w), linear_ref(x, w))
    assert double.calls == [] and "autograd" in op.fallback_reason


@pytest.mark.parametrize("kwargs, match", [
    (dict(rms_norm="deep_gemm"), "rms_norm='deep_gemm': no deep_gemm implementation"),
    (dict(sparse_attention="deep_gemm"), "sparse_attention='deep_gemm'"),
    (dict(linear="flashinfer"), "linear='flashinfer'"),
    (dict(linear="deepgemm"), "linear='deepgemm'"),
    (dict(moe_experts="deep_gemm"), "moe_experts='deep_gemm' needs fused_moe='triton'"),
])
def test_bad_configs_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KernelConfig(**kwargs)


def test_deep_gemm_is_never_a_default():
    for device in ("cpu", "cuda"):
        config = KernelConfig.for_device(device)
        assert "deep_gemm" not in (config.linear, config.moe_experts)
    KernelConfig(fused_moe="triton", moe_experts="deep_gemm", linear="deep_gemm")  # valid
