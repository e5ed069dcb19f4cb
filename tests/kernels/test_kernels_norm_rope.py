"""RMSNorm and RoPE ops (dspark/kernels/rms_norm.py, rope.py): fused Triton vs the torch references,
the references vs the models' former code, the autograd rule, and which ops the models pick.

Tiny shapes on CPU run the Triton kernels through the interpreter (conftest.py). RoPE must equal
its reference bit for bit in fp32 (same fp32 operations, no FMA); bf16 outputs bit for bit on the
GPU and within 1 ulp under the interpreter (its fp32 -> bf16 cast truncates). RMSNorm differs by
the order of the Σx² reduction and rsqrt's last bit only.
"""

import json
from importlib import resources

import pytest
import torch

from dspark.api import init_model
from dspark.kernels import KernelConfig, get_op, triton_available
from dspark.kernels import rms_norm as rn
from dspark.kernels import rope as rp
from dspark.models.deepseek_v4.norm import RMSNorm

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
# ‖Δ‖/‖ref‖ and max |Δ|/|ref| per element: fp32 a few ulp; bf16 1 ulp (2^-8 relative, 2^-7 at worst).
NORM_TOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def max_ulp_rel(out, ref):
    """Largest elementwise |Δ| / |ref| (ref never 0 here: random inputs)."""
    return ((out.double() - ref.double()).abs() / ref.double().abs().clamp_min(1e-30)).max().item()


def norm_inputs(shape, dtype, seed, weighted=True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(DEVICE, dtype)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE) if weighted else None
    return x, weight


def rope_inputs(x_shape, table_shape, dtype, seed):
    """x ~ N(0, 1); cos/sin of angles spanning many turns (positions up to 1e4), fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=g).to(DEVICE, dtype)
    angles = torch.rand(table_shape, generator=g) * 1e4
    return x, angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def assert_rope_equal(y, ref):
    assert y.shape == ref.shape and y.dtype == ref.dtype and not y.isnan().any()
    if y.dtype == torch.float32 or not INTERPRETED:
        assert torch.equal(y, ref)
    else:  # bf16 under the interpreter: truncating casts, at most 1 ulp
        assert max_ulp_rel(y, ref) <= 2 ** -7


# ---------------------------------------------------------------------------------------------
# rms_norm
# ---------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 64), (6, 257)])  # odd D, a partial row tile, one row
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_ref(dtype, shape, weighted, poisoned):
    x, weight = norm_inputs(shape, dtype, seed=len(shape) * 100 + shape[-1], weighted=weighted)
    for out_dtype in (dtype, torch.float32):  # RMSNorm / per-head q norm, and rms_scale's fp32
        with poisoned():
            y = rn.rms_norm(x, weight, eps=1e-6, out_dtype=out_dtype)
        ref = rn.rms_norm_ref(x, weight, eps=1e-6, out_dtype=out_dtype)
        assert y.shape == x.shape and y.dtype == out_dtype and not y.isnan().any()
        tol = NORM_TOL[out_dtype]
        assert rel_err(y, ref) < tol and max_ulp_rel(y, ref) <= 2 * tol


@needs_triton
def test_rms_norm_wide_rows_and_strided_rows(monkeypatch, poisoned):
    """Rows wider than one tile take the two-pass path; rows with a stride > D (a column slice) are
    read in place."""
    x, weight = norm_inputs((5, 50), torch.float32, seed=1)
    monkeypatch.setattr(rn, "_MAX_TILE", 16)
    with poisoned():
        y = rn.rms_norm(x, weight, eps=1e-5, out_dtype=torch.float32)
    assert rel_err(y, rn.rms_norm_ref(x, weight, eps=1e-5, out_dtype=torch.float32)) < NORM_TOL[torch.float32]
    monkeypatch.undo()
    wide, weight = norm_inputs((4, 40), torch.bfloat16, seed=2)
    view = wide[:, 3:33]  # [4, 30], row stride 40
    with poisoned():
        y = rn.rms_norm(view, weight[:30], eps=1e-6, out_dtype=torch.bfloat16)
    ref = rn.rms_norm_ref(view, weight[:30], eps=1e-6, out_dtype=torch.bfloat16)
    assert rel_err(y, ref) < NORM_TOL[torch.bfloat16]


def test_rms_norm_ref_is_the_former_model_code():
    """RMSNorm and rms_scale as the models computed them before the op, bit for bit (CPU)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 3, 33, generator=g).to(dtype)
        weight = torch.rand(33, generator=g) + 0.5
        x32 = x.float()
        scaled = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-6)
        assert torch.equal(rn.rms_norm_ref(x, None, eps=1e-6, out_dtype=torch.float32), scaled)
        assert torch.equal(rn.rms_norm_ref(x, weight, eps=1e-6, out_dtype=dtype), (weight * scaled).to(dtype))
        module = RMSNorm(33, 1e-6)
        module.weight.data.copy_(weight)
        assert torch.equal(module(x), (weight * scaled).to(dtype))


def test_rms_norm_validates_arguments():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight must be"):
        rn.rms_norm_ref(x, torch.ones(7), eps=1e-6, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="float tensor"):
        rn.rms_norm_ref(x.long(), None, eps=1e-6, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        rn.rms_norm_ref(x, None, eps=1e-6, out_dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# rope
# ---------------------------------------------------------------------------------------------

ROPE_CASES = [  # (x shape, cos/sin shape): the models' layouts, then other broadcasts
    ((5, 24), (5, 4)),  # kv latents, entries: [N, d] with [N, rd/2]
    ((5, 3, 24), (5, 1, 4)),  # q heads: [N, H, d] with [N, 1, rd/2]
    ((2, 3, 4, 16), (2, 3, 1, 8)),  # nope 0 (rd = d); leading dims merged to two
    ((3, 2, 13), (2, 3)),  # odd d (nope 7); tables per head, broadcast over N
    ((4, 13), (3,)),  # one table row for every row
    ((2, 3, 2, 20), (2, 1, 2, 5)),  # three strided dims: tables materialised per row
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(ROPE_CASES)))
def test_rope_matches_ref_and_inverts(dtype, case, poisoned):
    x_shape, table_shape = ROPE_CASES[case]
    x, cos, sin = rope_inputs(x_shape, table_shape, dtype, seed=case)
    with poisoned():
        y = rp.rope(x, cos, sin)
        back = rp.rope(y, cos, -sin)  # the inverse rotation
    assert_rope_equal(y, rp.rope_ref(x, cos, sin))
    assert_rope_equal(back, rp.rope_ref(y, cos, -sin))
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert rel_err(back, x) < tol and rel_err(y, x) > 0.1  # the rotation happened and undoes


@needs_triton
@pytest.mark.parametrize("min_programs", [1, 4])
@pytest.mark.parametrize("case", [0, 1, 3, 5])
def test_rope_multi_row_tiles_match_ref(case, min_programs, poisoned):
    """Several rows per program, with a masked tail (15 rows in tiles of 4 or 16): the launch shape
    of many rows, and min_programs=1, the former launch shape that the bench times."""
    x_shape, table_shape = ROPE_CASES[case]
    x, cos, sin = rope_inputs(x_shape, table_shape, torch.float32, seed=20 + case)
    with poisoned():
        y = rp.launch_rope(x, cos, sin, min_programs=min_programs)
    assert torch.equal(y, rp.rope_ref(x, cos, sin))


def test_rope_spreads_few_rows_over_programs():
    """The indexer q of one decode token (64 rows of d 128, 64 padded channels per tile) runs as 32
    programs of 2 rows (it was one program of 64); many rows keep 4096-element tiles."""
    assert rp.rows_per_program(64, 64, rp.MIN_PROGRAMS) == 2
    assert rp.rows_per_program(64, 64, 1) == 64
    assert rp.rows_per_program(1 << 16, 64, rp.MIN_PROGRAMS) == 64
    assert rp.rows_per_program(3, 512, rp.MIN_PROGRAMS) == 1


@needs_triton
def test_rope_of_a_strided_view_and_no_rows(poisoned):
    x, cos, sin = rope_inputs((6, 40), (3, 4), torch.float32, seed=9)
    view = x[::2, 4:36]  # [3, 32], non-contiguous rows
    with poisoned():
        y = rp.rope(view, cos, sin)
    assert torch.equal(y, rp.rope_ref(view, cos, sin))
    assert rp.rope(x[:0], cos[:0], sin[:0]).shape == (0, 40)


def test_rope_validates_arguments():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="must be equal"):
        rp.rope_ref(x, torch.ones(3, 2), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="fit"):
        rp.rope_ref(x, torch.ones(3, 5), torch.zeros(3, 5))
    if triton_available():
        with pytest.raises(ValueError, match="broadcast"):
            rp.rope(x, torch.ones(4, 2), torch.zeros(4, 2))


# ---------------------------------------------------------------------------------------------
# autograd: the fused ops run their references while autograd records
# ---------------------------------------------------------------------------------------------


@needs_triton
def test_fused_ops_run_the_references_under_autograd(monkeypatch):
    """With an input or weight requiring grad (and grad mode on) the fused ops delegate to the
    references, so gradients flow and equal the references' exactly; otherwise the kernel runs."""
    x, weight = norm_inputs((4, 16), torch.float32, seed=3)
    _, cos, sin = rope_inputs((4, 16), (4, 4), torch.float32, seed=3)
    grads = []
    for op, ref in ((rn.rms_norm, rn.rms_norm_ref), (rp.rope, rp.rope_ref)):
        for fn in (op, ref):
            leaf = x.clone().requires_grad_(True)
            w = weight.clone().requires_grad_(True)
            out = fn(leaf, w, eps=1e-6, out_dtype=torch.float32) if op is rn.rms_norm else fn(leaf * w, cos, sin)
            (out * torch.arange(16.0, device=DEVICE)).sum().backward()
            grads.append((leaf.grad, w.grad))
    for fused, ref in (grads[0:2], grads[2:4]):
        assert all(g is not None and torch.equal(g, r) for g, r in zip(fused, ref))

    calls, reference = [], rp.rope_ref
    monkeypatch.setattr(rp, "rope_ref", lambda *args: calls.append(1) or reference(*args))
    leaf = x.clone().requires_grad_(True)
    rp.rope(leaf, cos, sin)
    assert len(calls) == 1  # recorded: the reference
    with torch.no_grad():
        rp.rope(leaf, cos, sin)
    rp.rope(x, cos, sin)  # grad mode on, nothing requires grad
    assert len(calls) == 1  # the kernel both times


# ---------------------------------------------------------------------------------------------
# the models pick the ops from their KernelConfig
# ---------------------------------------------------------------------------------------------


def tiny_config(name: str) -> dict:
    return json.loads(resources.files("dspark.configs").joinpath(name).read_text())


def picked_ops(model) -> tuple[set, set]:
    """(every RMSNorm module's op, every rope op held by a module) of `model`."""
    norms = {m.norm_op for m in model.modules() if isinstance(m, RMSNorm)}
    ropes = {m.rope_op for m in model.modules() if hasattr(m, "rope_op")}
    norms |= {m.norm_op for m in model.modules() if hasattr(m, "norm_op") and not isinstance(m, RMSNorm)}
    return norms, ropes


@needs_triton
@pytest.mark.parametrize("name", ["tiny-v4.json", "tiny-v41.json"])
def test_models_pick_the_ops_from_their_kernel_config(name):
    triton_ops = (get_op(KernelConfig.uniform("triton"), "rms_norm"), get_op(KernelConfig.uniform("triton"), "rope"))
    assert triton_ops == (rn.rms_norm, rp.rope)
    fused = init_model(tiny_config(name), device="cpu", kernels=KernelConfig.uniform("triton"))
    ref = init_model(tiny_config(name), device="cpu", kernels=KernelConfig.uniform("ref"))
    assert picked_ops(fused) == ({rn.rms_norm}, {rp.rope})
    assert picked_ops(ref) == ({rn.rms_norm_ref}, {rp.rope_ref})
    # the model-level norm and a CSA layer's compressor and indexer, by name
    assert fused.norm.norm_op is rn.rms_norm and fused.layers[0].attn.rope_op is rp.rope


# ---------------------------------------------------------------------------------------------
# GPU: real sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 64, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_shapes_on_gpu(n, dtype):
    """V4 sizes: RoPE (rd 64) of q heads [n, 64, 512], kv latents [n, 512] and indexer q [n, 64, 128]
    bit for bit (no FMA contraction in the kernel); RMSNorm of the hidden (4096, V4-Pro 7168),
    q_lora (1024), the per-head q norm (512, unweighted) and rms_scale's fp32 output within the
    tolerance of the reference, and both within it of a float64 computation."""
    for x_shape, table_shape in (((n, 64, 512), (n, 1, 32)), ((n, 512), (n, 32)), ((n, 64, 128), (n, 1, 32))):
        x, cos, sin = rope_inputs(x_shape, table_shape, dtype, seed=n)
        assert torch.equal(rp.rope(x, cos, sin), rp.rope_ref(x, cos, sin))
        assert torch.equal(rp.rope(x, cos, -sin), rp.rope_ref(x, cos, -sin))
    for shape, weighted, out_dtype in (((n, 4096), True, dtype), ((n, 7168), True, dtype), ((n, 1024), True, dtype),
                                       ((n, 64, 512), False, dtype), ((n, 4096), False, torch.float32)):
        x, weight = norm_inputs(shape, dtype, seed=n, weighted=weighted)
        y = rn.rms_norm(x, weight, eps=1e-6, out_dtype=out_dtype)
        ref = rn.rms_norm_ref(x, weight, eps=1e-6, out_dtype=out_dtype)
        x64 = x.double()
        exact = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6)
        exact = exact if weight is None else weight.double() * exact
        tol = NORM_TOL[out_dtype]
        assert rel_err(y, ref) < tol and max_ulp_rel(y, ref) <= 2 * tol
        assert rel_err(y, exact) < tol and rel_err(ref, exact) < tol
