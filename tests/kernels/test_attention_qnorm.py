"""`sparse_attention_qnorm` (dspark/kernels/attention.py): V4's per-head q norm and RoPE inside the attention's
`_partial_kernel` (`Q_NORM_FOLD`) against the reference (`norm_rope_ref`, then `sparse_attention_ref`) and the
two launches it replaces, on random inputs; where the op takes the fold; argument errors; and V4's static step
with the fold on (tiny-v4, fp32, verify rounds: the same logits within fp32 tolerance)."""

import dataclasses

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig, triton_available
from dspark.kernels import attention as op
from dspark.kernels.attention_ref import sparse_attention_qnorm_ref
from dspark.kernels.norm_rope import norm_rope
from dspark.models.deepseek_v4.static_step import StaticDecoder

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from static_step_checks import run_rounds  # noqa: E402

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # ‖Δ‖/‖ref‖ (bf16: q rounded twice, P in bf16)


def qnorm_inputs(n_q, n_heads, head_dim, rd, n_keys, pool_rows, dtype, seed, device=DEVICE):
    """Raw q heads [S, H, d] at a scale far from 1 (the norm matters), cos / sin [S, rd/2] (row 0 at position 0),
    pool [P, d], index [S, K] with −1 holes, sink [H] fp32."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n_q, n_heads, head_dim, generator=g) * 7.0).to(device, dtype)
    angles = torch.rand(n_q, rd // 2, generator=g) * 6.0
    angles[0] = 0.0
    pool = torch.randn(pool_rows, head_dim, generator=g).to(device, dtype)
    index = torch.randint(0, pool_rows, (n_q, n_keys), generator=g)
    index[:, ::5] = -1
    sink = torch.randn(n_heads, generator=g).to(device)
    return q, angles.cos().to(device), angles.sin().to(device), pool, index.to(device), sink


def two_launches(q, cos, sin, pool, index, sink, scale, eps, tiles):
    return op.launch_sparse_attention(norm_rope(q, None, cos.unsqueeze(-2), sin.unsqueeze(-2), eps=eps), pool, index,
                                      sink, scale, tiles)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_q,n_heads,head_dim,rd,n_keys", [
    (1, 4, 64, 16, 40),    # one decode query, one masked head block
    (3, 20, 64, 16, 70),   # verify rows, two head blocks (16 + 4)
    (2, 4, 48, 48, 33),    # head_dim off a power of two (padded columns), every dim rotary
])
def test_fold_follows_the_reference_and_the_two_launches(dtype, n_q, n_heads, head_dim, rd, n_keys, poisoned):
    q, cos, sin, pool, index, sink = qnorm_inputs(n_q, n_heads, head_dim, rd, n_keys, 50, dtype, seed=n_q + n_heads)
    scale, eps, tiles = head_dim ** -0.5, 1e-6, op.op_tiles(n_q, n_heads, head_dim)
    with poisoned():
        out = op.launch_sparse_attention(q, pool, index, sink, scale, tiles, qnorm=(cos, sin, eps))
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    ref = sparse_attention_qnorm_ref(q, cos, sin, pool, index, sink, scale, eps=eps)
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(out, two_launches(q, cos, sin, pool, index, sink, scale, eps, tiles)) < TOL[dtype]
    # the raw heads attended unnormalised and unrotated are far off: the fold did normalise and rotate
    assert rel_err(op.launch_sparse_attention(q, pool, index, sink, scale, tiles), ref) > 10 * TOL[dtype]


@needs_triton
@pytest.mark.parametrize("fold,n_q,head_dim,folded", [
    (True, 2, 64, True),      # the fold where `_partial_kernel` runs
    (False, 2, 64, False),    # the candidate off: norm_rope, then the attention
    (True, 64, 512, False),   # 64 rows of 512: `attention_wide`, so norm_rope first
])
def test_the_op_folds_only_with_the_flag_and_partial_kernel_tiles(fold, n_q, head_dim, folded, monkeypatch):
    monkeypatch.setattr(op, "Q_NORM_FOLD", fold)
    q, cos, sin, pool, index, sink = qnorm_inputs(n_q, 4, head_dim, 16, 24, 30, torch.float32, seed=n_q)
    calls, launch = [], op.launch_sparse_attention
    monkeypatch.setattr(op, "launch_sparse_attention", lambda *a, **k: calls.append(k) or launch(*a, **k))
    out = op.sparse_attention_qnorm(q, cos, sin, pool, index, sink, head_dim ** -0.5, eps=1e-6)
    assert [k.get("qnorm") is not None for k in calls] == [folded]
    assert op.sparse_attention_qnorm.folds(n_q, 4, head_dim) == folded  # what V4's static step asks
    ref = sparse_attention_qnorm_ref(q, cos, sin, pool, index, sink, head_dim ** -0.5, eps=1e-6)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_bad_arguments_name_the_values():
    q, cos, sin, pool, index, sink = qnorm_inputs(2, 4, 64, 16, 24, 30, torch.float32, seed=1, device="cpu")
    with pytest.raises(ValueError, match=r"cos / sin \[S, rd/2\] with 0 < rd <= d, got q \(2, 4, 64\), cos \(1, 8\)"):
        sparse_attention_qnorm_ref(q, cos[:1], sin[:1], pool, index, sink, 0.125, eps=1e-6)
    with pytest.raises(ValueError, match="eps must be > 0, got 0"):
        sparse_attention_qnorm_ref(q, cos, sin, pool, index, sink, 0.125, eps=0)


@needs_triton
def test_launch_rejects_the_fold_with_wide_tiles():
    q, cos, sin, pool, index, sink = qnorm_inputs(1, 4, 64, 16, 24, 30, torch.float32, seed=2)
    with pytest.raises(ValueError, match="not with wide tiles"):
        op.launch_sparse_attention(q, pool, index, sink, 0.125, op.wide_tiles(4), qnorm=(cos, sin, 1e-6))


def test_only_v4_with_the_three_ops_on_triton_takes_the_op():
    for kernels in (KernelConfig(), KernelConfig(sparse_attention_qnorm="triton", sparse_attention="triton")):
        model = dspark.init_model("tiny-v4", seed=0, kernels=kernels)
        assert all(layer.attn.attend_qnorm_op is None for layer in model.layers)


@needs_triton
@torch.no_grad()
def test_v4_static_step_with_the_fold_follows_the_two_launches(monkeypatch):
    """V4's static step (verify rounds of 4 tokens, 2 slots) with `Q_NORM_FOLD` on and off: the attention got raw
    heads from every layer, and the logits agree within fp32 tolerance (Σq² reduces in another order)."""
    kernels = dataclasses.replace(KernelConfig.for_device(DEVICE), sparse_attention="triton", norm_rope="triton",
                                  sparse_attention_qnorm="triton")
    model = dspark.init_model("tiny-v4", seed=0, device=DEVICE, dtype=torch.float32, kernels=kernels)
    assert all(layer.attn.attend_qnorm_op is op.sparse_attention_qnorm for layer in model.layers)
    calls, launch = [], op.launch_sparse_attention
    monkeypatch.setattr(op, "launch_sparse_attention", lambda *a, **k: calls.append(k) or launch(*a, **k))
    norms = []
    monkeypatch.setattr(op, "norm_rope", lambda *a, **k: norms.append(1) or norm_rope(*a, **k))
    apart = torch.stack(run_rounds(StaticDecoder, model, None, rounds=2))
    assert calls and not any(k.get("qnorm") is not None for k in calls)
    assert not norms  # with the fold off the step normalises q itself (before the lanes' joins), not the op
    calls.clear()
    monkeypatch.setattr(op, "Q_NORM_FOLD", True)
    folded = torch.stack(run_rounds(StaticDecoder, model, None, rounds=2))
    assert sum(k.get("qnorm") is not None for k in calls) >= 2 * 2 * len(model.layers)  # every layer, every step
    torch.testing.assert_close(folded, apart, atol=2e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("n_q,n_heads", [(1, 32), (4, 32), (1, 64)])
def test_model_shapes_on_gpu(n_q, n_heads):
    """v4-mini's (32 heads) and V4-Flash's (64) decode and verify queries, head_dim 512, rd 64, bf16, 640 keys."""
    q, cos, sin, pool, index, sink = qnorm_inputs(n_q, n_heads, 512, 64, 640, 4096, torch.bfloat16, seed=n_q)
    scale, eps, tiles = 512 ** -0.5, 1e-6, op.op_tiles(n_q, n_heads, 512)
    out = op.launch_sparse_attention(q, pool, index, sink, scale, tiles, qnorm=(cos, sin, eps))
    ref = sparse_attention_qnorm_ref(q, cos, sin, pool, index, sink, scale, eps=eps)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert rel_err(out, two_launches(q, cos, sin, pool, index, sink, scale, eps, tiles)) < TOL[torch.bfloat16]
