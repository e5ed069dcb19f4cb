"""V4.1's Engram gate (dspark/kernels/engram_gate.py): the fused kernel against its torch reference,
and the Engram layer on either (CPU: Triton interpreter, tiny shapes; a GPU runs them at real ones)."""

import pytest
import torch

from dspark.kernels import KernelConfig, engram_gate, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(n, hc, dim, dtype, seed, live=True):
    """x, kv, q_weight, k_weight, live: random, with a shut gate (live False) and a near-zero dot row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hc, dim, generator=g)
    kv = torch.randn(n, (hc + 1) * dim, generator=g)
    kv[:1, :dim] = 0.0  # stream 0 of token 0: a zero key, so its dot is 0 (the sign's zero)
    q_w, k_w = torch.rand(hc, dim, generator=g) + 0.5, torch.rand(hc, dim, generator=g) + 0.5
    alive = torch.rand(n, generator=g) > 0.3 if live else None
    to = dict(device=DEVICE)
    return (x.to(dtype=dtype, **to), kv.to(dtype=dtype, **to), q_w.to(dtype=dtype, **to), k_w.to(dtype=dtype, **to),
            None if alive is None else alive.to(**to))


@needs_triton
@pytest.mark.parametrize("n,hc,dim,dtype,live", [(3, 4, 64, torch.float32, True), (5, 2, 96, torch.bfloat16, True),
                                                  (2, 4, 1100, torch.float32, False), (0, 4, 64, torch.float32, True)])
def test_fused_gate_matches_reference(n, hc, dim, dtype, live, poisoned):
    """Shapes: D one tile, D off the tile (96), D over one 1024-wide tile (two passes), no tokens."""
    args = inputs(n, hc, dim, dtype, seed=dim, live=live)
    with poisoned():
        y = engram_gate.engram_gate(*args, eps=1e-6)
    ref = engram_gate.engram_gate_ref(*args, eps=1e-6)
    assert y.dtype == dtype and y.shape == (n, hc, dim)
    if n:
        err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 1e-2)
        if live:  # a shut gate adds nothing
            shut = ~args[4]
            assert torch.equal(y[shut], args[0][shut])


def test_bad_arguments_name_the_value():
    x, kv, q_w, k_w, live = inputs(3, 4, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="kv must be"):
        engram_gate.engram_gate_ref(x, kv[:, :-1], q_w, k_w, live, eps=1e-6)
    with pytest.raises(ValueError, match="k_weight must be"):
        engram_gate.engram_gate_ref(x, kv, q_w, k_w[:2], live, eps=1e-6)
    with pytest.raises(ValueError, match="live must be"):
        engram_gate.engram_gate_ref(x, kv, q_w, k_w, live.float(), eps=1e-6)


@needs_triton
def test_v41_model_logits_with_the_fused_gate_match_the_reference():
    """tiny-v41 (two Engram layers) with `engram_gate` on Triton: the forward's logits match the
    reference model's, and under autograd the op falls back to its reference (no backward)."""
    import dspark

    kw = dict(seed=0, prefill_mode="exact", cache_qat=False)
    ref = dspark.init_model("tiny-v41", **kw)
    fused = dspark.init_model("tiny-v41", kernels=KernelConfig(engram_gate="triton"), **kw)
    ref.to(DEVICE), fused.to(DEVICE)
    assert any(layer.engram is not None for layer in fused.layers)
    ids = torch.randint(0, 200, (12,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        a = ref(ids, [ref.new_state()], [12]).logits
        b = fused(ids, [fused.new_state()], [12]).logits
    assert ((a - b).norm() / a.norm()).item() < 1e-5
    x, kv, q_w, k_w, live = inputs(2, 4, 64, torch.float32, seed=3)
    x.requires_grad_(True)
    engram_gate.engram_gate(x, kv, q_w, k_w, live, eps=1e-6).sum().backward()
    assert x.grad is not None
