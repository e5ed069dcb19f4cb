"""The optional deep_gemm MoE experts (dspark/kernels/moe_deep_gemm.py) on CPU.

Without deep_gemm the op is `moe_experts_ref` bit for bit; with the test double of `deep_gemm_double.py`
(contiguous layout checks included) it matches the W8A8 torch reference and, within fp8 error, the
weights-only reference.
"""

import sys
import warnings

import pytest
import torch

import deep_gemm_double
from deep_gemm_double import double  # noqa: F401 (the fixture)
from dspark.kernels import KernelConfig, get_op
from dspark.kernels import deep_gemm_path as dg
from dspark.kernels import moe_deep_gemm as mdg
from dspark.kernels.fp8 import FP8BlockWeight
from dspark.kernels.moe import _pack_by_expert, moe_experts_ref

CONFIG = KernelConfig(fused_moe="triton", moe_experts="deep_gemm")
LIMIT = 7.0


def _experts(n_tok=5, dim=256, inter=128, inter_s=128, n_exp=4, top_k=2, fp8_block=None, seed=0):
    """(x, weights, ids, w1, w2, w3, shared_w1, shared_w2, shared_w3): bf16, or FP8 with `fp8_block`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, dim, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(n_tok)]).to(torch.int32)
    weights = torch.rand(n_tok, top_k, generator=g) + 0.5

    def w(*shape):
        t = torch.randn(*shape, generator=g) / shape[-1] ** 0.5
        return FP8BlockWeight.quantize(t, fp8_block) if fp8_block else t.to(torch.bfloat16)

    return (x, weights, ids, w(n_exp, inter, dim), w(n_exp, dim, inter), w(n_exp, inter, dim),
            w(inter_s, dim), w(dim, inter_s), w(inter_s, dim))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("fp8_block", [None, 128])
def test_without_deep_gemm_the_op_is_the_reference_bit_for_bit(monkeypatch, fp8_block):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    args = _experts(fp8_block=fp8_block)
    op = get_op(CONFIG, "moe_experts")
    with pytest.warns(RuntimeWarning, match="moe_experts='deep_gemm' falls back: deep_gemm does not import"):
        y = op(*args, swiglu_limit=LIMIT)
    assert torch.equal(y, moe_experts_ref(*args, swiglu_limit=LIMIT)) and "import" in op.fallback_reason


@pytest.mark.parametrize("fp8_block", [None, 128])
def test_wrapper_honours_the_contract_and_matches_w8a8_reference(double, fp8_block):
    x, weights, ids, *ws = _experts(fp8_block=fp8_block)
    experts = mdg.DeepGemmExperts.from_weights(*ws)
    y = mdg.moe_experts_deep_gemm(dg.load_api(), x, weights, ids, experts, LIMIT)
    assert double.calls == ["grouped_contiguous", "grouped_contiguous", "gemm_nt", "gemm_nt"]
    assert y.dtype == x.dtype and y.shape == x.shape and bool(y.isfinite().all())  # skipped (NaN) rows unread
    torch.testing.assert_close(y, mdg.moe_experts_w8a8_ref(x, weights, ids, experts, LIMIT), rtol=2**-7, atol=1e-5)
    # Against the weights-only MoE: fp8 activation (and bf16-weight) quantisation error, not rounding.
    assert 1e-2 < _rel(y, moe_experts_ref(x.float(), weights, ids, *ws, swiglu_limit=LIMIT)) < 0.1  # measured 0.047-0.066 (bf16: 0.0016)


def test_layout_marks_padding_as_the_release_expects():
    ids = torch.tensor([[0], [0], [2], [0], [2]])  # expert 0: 3 rows, expert 2: 2 rows; alignment 2
    rows, block_expert, _ = _pack_by_expert(ids, 3, 2)  # R = 5 + 3 = 8 rows, 4 blocks, the last unused
    assert rows.tolist() == [0, 1, 3, 5, 2, 4, 5, 5] and block_expert.tolist() == [0, 0, 2, 3]
    assert mdg.grouped_layout(rows, block_expert, 5, 3, 2, legacy=False).tolist() == [0, 0, 0, -1, 2, 2, -1, -1]
    assert mdg.grouped_layout(rows, block_expert, 5, 3, 2, legacy=True).tolist() == [0, 0, 0, 0, 2, 2, 0, 0]


def test_op_uses_the_reported_alignment_and_converts_once(monkeypatch):
    module = deep_gemm_double.make(alignment=64)
    monkeypatch.setitem(sys.modules, "deep_gemm", module)
    monkeypatch.setattr(dg, "device_reason", lambda device: None)
    args = _experts(n_tok=7, top_k=3, fp8_block=128)
    op = get_op(CONFIG, "moe_experts")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = op(*args, swiglu_limit=LIMIT)
        assert op.fallback_reason is None and module.calls.count("grouped_contiguous") == 2
        converted = next(iter(op._weights.values()))
        assert torch.equal(op(*args, swiglu_limit=LIMIT), y) and next(iter(op._weights.values())) is converted
    experts = mdg.DeepGemmExperts.from_weights(*args[3:])
    torch.testing.assert_close(y, mdg.moe_experts_w8a8_ref(*args[:3], experts, LIMIT), rtol=2**-7, atol=1e-5)


def test_op_falls_back_for_v41_blocks_and_odd_widths(double):
    op = get_op(CONFIG, "moe_experts")
    for kwargs, match in ((dict(fp8_block=32), "block 32"), (dict(inter=96), "I % 128 == 0")):
        args = _experts(**kwargs)
        with pytest.warns(RuntimeWarning, match=match):
            assert torch.equal(op(*args, swiglu_limit=LIMIT), moe_experts_ref(*args, swiglu_limit=LIMIT))
    assert double.calls == []
    with pytest.raises(ValueError, match="w2 must be"):  # bad input raises whichever path would run
        x, weights, ids, w1, w2, *rest = _experts()
        op(x, weights, ids, w1, w2[:, :, :64], *rest, swiglu_limit=LIMIT)
