"""A torch test double of the `deep_gemm` module: DeepGEMM's documented FP8 GEMM contract on CPU.

No deep_gemm build runs on our machines, so the plumbing of `dspark.kernels.deep_gemm_path` and
`moe_deep_gemm` is checked against this stand-in. Each entry point asserts what the library requires
of its arguments (dtypes, shapes, K-major operands, the MN-major TMA-aligned LHS scales, 128-row
alignment of the contiguous layout, one group per alignment block), then computes what the kernel
computes: (A · sfa) @ (B · sfb)ᵀ in fp32, rounded once to bf16. Rows the current release skips (-1 in
a contiguous layout) are written as NaN, so a caller that reads them fails.

`make(legacy=True)` exposes the older release's names and its stricter layout (no -1 rows). The
`double` fixture (import it into a test module) installs either as `deep_gemm`.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from dspark.kernels import deep_gemm_path

GRAN = 128


def _tma_aligned(mn: int) -> int:
    return (mn + 3) // 4 * 4  # fp32: 16-byte columns


def _lhs(a: torch.Tensor, sfa: torch.Tensor) -> torch.Tensor:
    assert a.dtype == torch.float8_e4m3fn and a.dim() == 2 and a.is_contiguous(), (a.dtype, a.shape, a.stride())
    m, k = a.shape
    assert k % GRAN == 0, k
    assert sfa.dtype == torch.float32 and tuple(sfa.shape) == (m, k // GRAN), (sfa.dtype, sfa.shape)
    assert sfa.stride() == (1, _tma_aligned(m)), f"LHS scales must be MN-major TMA-aligned, got {sfa.stride()}"
    return a.float() * sfa.repeat_interleave(GRAN, dim=1)


def _rhs(b: torch.Tensor, sfb: torch.Tensor) -> torch.Tensor:
    assert b.dtype == torch.float8_e4m3fn and b.dim() in (2, 3) and b.is_contiguous(), (b.dtype, b.shape)
    n, k = b.shape[-2:]
    assert n % 64 == 0 and k % GRAN == 0, (n, k)
    want = (*b.shape[:-2], -(-n // GRAN), k // GRAN)
    assert sfb.dtype == torch.float32 and tuple(sfb.shape) == want and sfb.is_contiguous(), (sfb.dtype, sfb.shape)
    return b.float() * sfb.repeat_interleave(GRAN, dim=-2)[..., :n, :].repeat_interleave(GRAN, dim=-1)


def _out(d: torch.Tensor, m: int, n: int) -> None:
    assert d.dtype == torch.bfloat16 and tuple(d.shape) == (m, n) and d.stride(-1) == 1, (d.dtype, d.shape)


def make(legacy: bool = False, alignment: int = 128) -> types.ModuleType:
    """A fresh `deep_gemm` stand-in; `module.calls` lists the entry points called, in order."""
    module = types.ModuleType("deep_gemm")
    module.__version__ = "1.0-double" if legacy else "2.1-double"
    module.calls = []

    def gemm_nt(a, b, d, c=None, **options):
        module.calls.append("gemm_nt")
        x, w = _lhs(*a), _rhs(*b)
        _out(d, x.shape[0], w.shape[0])
        d.copy_(x @ w.T)

    def grouped_contiguous(a, b, d, grouped_layout, **options):
        module.calls.append("grouped_contiguous")
        x, w = _lhs(*a), _rhs(*b)
        m, n = x.shape[0], w.shape[1]
        _out(d, m, n)
        assert grouped_layout.dtype == torch.int32 and tuple(grouped_layout.shape) == (m,)
        assert grouped_layout.is_contiguous() and m % alignment == 0, (grouped_layout.shape, alignment)
        for start in range(0, m, alignment):
            block = grouped_layout[start:start + alignment]
            group = int(block[0])
            if legacy:  # the block's first id picks the weights, unchecked: every row names one group
                assert bool((block == group).all()) and 0 <= group < w.shape[0], block
            else:
                assert bool(((block == group) | (block == -1)).all()) and -1 <= group < w.shape[0], block
            valid = block >= 0
            rows = torch.arange(start, start + alignment, device=d.device)
            d[rows[~valid]] = float("nan")
            if group >= 0:
                d[rows[valid]] = (x[rows[valid]] @ w[group].T).to(d.dtype)

    def get_alignment() -> int:
        return alignment

    if legacy:
        module.gemm_fp8_fp8_bf16_nt = gemm_nt
        module.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous = grouped_contiguous
        module.get_m_alignment_for_contiguous_layout = get_alignment
    else:
        module.fp8_gemm_nt = gemm_nt
        module.m_grouped_fp8_gemm_nt_contiguous = grouped_contiguous
        module.get_mk_alignment_for_contiguous_layout = get_alignment
        module.get_m_alignment_for_contiguous_layout = get_alignment  # the current release keeps the alias
    return module


@pytest.fixture(params=[False, True], ids=["current", "older"])
def double(request, monkeypatch):
    """The test double (current and older API) as `deep_gemm`, on a device that passes the Hopper check."""
    module = make(legacy=request.param)
    monkeypatch.setitem(sys.modules, "deep_gemm", module)
    monkeypatch.setattr(deep_gemm_path, "device_reason", lambda device: None)
    return module
