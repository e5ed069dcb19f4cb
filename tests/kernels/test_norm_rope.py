"""Norm + RoPE op (dspark/kernels/norm_rope.py): the fused kernel against the two ops in sequence and
the reference, the store at out[out_rows], argument checks, and its use by the attention's
`project_qkv` (launch counts) and the V4 static step (no window `index_copy_`).

Tiny shapes on CPU run the Triton kernels through the interpreter (conftest.py). The kernel does
`rms_norm`'s and `rope`'s operations in the same order on the same tiles, so it equals the fused
pair `rope(rms_norm(x))` bit for bit (interpreter and GPU alike), and the references within
`rms_norm`'s own tolerance (the Σx² reduction order and rsqrt's last bit, then bf16 rounding; the
interpreter's fp32 -> bf16 cast truncates).
"""

import math

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig, triton_available
from dspark.kernels import norm_rope as nr
from dspark.kernels import rms_norm as rn
from dspark.kernels import rope as rp
from dspark.models.deepseek_v4.static_state import StaticShape
from dspark.models.deepseek_v4.static_step import StaticDecoder

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7}  # ‖Δ‖/‖ref‖ against the references

CASES = [  # (x shape, cos/sin shape, weighted): the models' layouts, d not a power of two, odd nope
    ((5, 3, 24), (5, 1, 4), False),  # q heads [N, H, d] with [N, 1, rd/2]: V4's unweighted per-head norm
    ((5, 24), (5, 4), True),  # kv latents [N, d] with [N, rd/2]: kv_norm's weight
    ((4, 13), (4, 3), True),  # d 13, nope 7 (odd)
    ((3, 2, 20), (3, 1, 10), False),  # nope 0 (rd = d), several rows per table row
    ((1, 6, 40), (1, 1, 8), True),  # one token, weighted heads
]


def inputs(x_shape, table_shape, weighted, dtype, seed):
    """x ~ 3·N(0, 1) + 0.5 (never zero rows), weight in [0.5, 1.5), angles spanning many turns."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(x_shape, generator=g) * 3 + 0.5).to(DEVICE, dtype)
    weight = (torch.rand(x_shape[-1], generator=g) + 0.5).to(DEVICE) if weighted else None
    angles = torch.rand(table_shape, generator=g) * 1e4
    return x, weight, angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def fused_pair(x, weight, cos, sin, eps=1e-6):
    """The two fused ops in sequence: what the models ran before on CUDA."""
    return rp.rope(rn.rms_norm(x, weight, eps=eps, out_dtype=x.dtype), cos, sin)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_norm_rope_equals_the_two_ops(dtype, case, poisoned):
    x_shape, table_shape, weighted = CASES[case]
    x, weight, cos, sin = inputs(x_shape, table_shape, weighted, dtype, seed=case)
    with poisoned():
        y = nr.norm_rope(x, weight, cos, sin, eps=1e-6)
    ref = nr.norm_rope_ref(x, weight, cos, sin, eps=1e-6)
    assert y.shape == x.shape and y.dtype == dtype and not y.isnan().any()
    assert torch.equal(y, fused_pair(x, weight, cos, sin))
    assert rel_err(y, ref) < TOL[dtype]
    normed = rn.rms_norm_ref(x, weight, eps=1e-6, out_dtype=dtype)
    assert rel_err(y, normed) > 0.1  # the rotation happened


def test_norm_rope_ref_is_rms_norm_ref_then_rope_ref():
    for case, dtype in ((0, torch.bfloat16), (1, torch.float32), (2, torch.bfloat16)):
        x, weight, cos, sin = (t.cpu() if t is not None else None for t in inputs(*CASES[case], dtype, seed=case))
        want = rp.rope_ref(rn.rms_norm_ref(x, weight, eps=1e-5, out_dtype=dtype), cos, sin)
        assert torch.equal(nr.norm_rope_ref(x, weight, cos, sin, eps=1e-5), want)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", [0, 1])
def test_rows_stored_at_out_rows(fused, case, poisoned):
    """out [R, d] poisoned with NaN: the M rows of y land at out_rows (any order), every other row stays
    NaN; y is returned as without `out`."""
    if fused and not triton_available():
        pytest.skip("triton not installed")
    op = nr.norm_rope if fused else nr.norm_rope_ref
    x, weight, cos, sin = inputs(*CASES[case], torch.float32, seed=10 + case)
    dim, n_rows = x.shape[-1], math.prod(x.shape[:-1])
    out = torch.full((n_rows + 7, dim), float("nan"), device=DEVICE)
    rows = torch.randperm(n_rows + 7, generator=torch.Generator().manual_seed(case))[:n_rows].to(DEVICE)
    with poisoned():
        y = op(x, weight, cos, sin, eps=1e-6, out=out, out_rows=rows)
    assert torch.equal(y, op(x, weight, cos, sin, eps=1e-6))
    assert torch.equal(out[rows], y.reshape(-1, dim))
    untouched = torch.ones(out.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[rows] = False
    assert untouched.sum() == 7 and out[untouched].isnan().all()


@pytest.mark.parametrize("op_name", ["norm_rope_ref", "norm_rope"])
def test_bad_arguments_raise_naming_the_value(op_name):
    if op_name == "norm_rope" and not triton_available():
        pytest.skip("triton not installed")
    op = getattr(nr, op_name)
    x, cos, sin = torch.randn(3, 2, 16), torch.ones(3, 1, 4), torch.zeros(3, 1, 4)
    out, rows = torch.zeros(9, 16), torch.arange(6)
    bad = [
        (dict(weight=torch.ones(15)), r"weight must be \[D=16\].*\(15,\)"),
        (dict(x=x.long()), "float tensor.*torch.int64"),
        (dict(cos=torch.ones(3, 1, 9), sin=torch.zeros(3, 1, 9)), "9/9.*last dim 16"),
        (dict(out=out), "out and out_rows go together"),
        (dict(out=out.double(), out_rows=rows), r"out must be \[R, d=16\] torch.float32.*torch.float64"),
        (dict(out=torch.zeros(9, 17), out_rows=rows), r"\(9, 17\)"),
        (dict(out=torch.zeros(16, 9).t(), out_rows=rows), "contiguous rows"),
        (dict(out=out, out_rows=rows[:5]), r"out_rows must be long \[M=6\].*\(5,\)"),
        (dict(out=out, out_rows=rows.int()), "torch.int32"),
    ]
    for change, message in bad:
        args = {**dict(x=x, weight=None, cos=cos, sin=sin, out=None, out_rows=None), **change}
        with pytest.raises(ValueError, match=message):
            op(args.pop("x"), args.pop("weight"), args.pop("cos"), args.pop("sin"), eps=1e-6, **args)
    if op_name == "norm_rope":
        with pytest.raises(ValueError, match="d=8200 exceeds 8192"):
            op(torch.randn(1, 8200), None, torch.ones(1, 4), torch.zeros(1, 4), eps=1e-6)
        with pytest.raises(ValueError, match="broadcast"):
            op(torch.randn(3, 16), None, torch.ones(4, 4), torch.zeros(4, 4), eps=1e-6)


@needs_triton
def test_runs_the_reference_under_autograd():
    x, weight, cos, sin = inputs((4, 16), (4, 4), True, torch.float32, seed=3)
    grads = []
    for op in (nr.norm_rope, nr.norm_rope_ref):
        leaf, w = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        (op(leaf, w, cos, sin, eps=1e-6) * torch.arange(16.0, device=DEVICE)).sum().backward()
        grads.append((leaf.grad, w.grad))
    assert all(g is not None and torch.equal(g, r) for g, r in zip(*grads))


# ---------------------------------------------------------------------------------------------
# the attention's q / kv projection and the V4 static step
# ---------------------------------------------------------------------------------------------


class Counter:
    """Stands in for a kernel: counts its launches, then launches it."""

    def __init__(self, kernel, name: str, log: list):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(self.name)
            return self.kernel[grid](*args, **kwargs)

        return launch


@needs_triton
@torch.no_grad()
def test_project_qkv_launches_two_norm_rope_kernels_where_it_launched_four(monkeypatch):
    """V4's `project_qkv` with rms_norm and rope fused: per-head q norm, RoPE, kv_norm, RoPE = 4
    launches (+ q_norm's); with norm_rope fused too: 2 (+ q_norm's), the same q, kv and c_q bit for
    bit, and with kv_out / kv_rows the kv rows stored by the kernel, no `index_copy_`."""
    log = []
    for module, name in ((rn, "_rms_norm_kernel"), (rp, "_rope_kernel"), (nr, "_norm_rope_kernel")):
        monkeypatch.setattr(module, name, Counter(getattr(module, name), name, log))
    copies = []
    index_copy = torch.Tensor.index_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda *a: copies.append(1) or index_copy(*a))
    g = torch.Generator().manual_seed(0)
    results = {}
    for fused in (False, True):
        kernels = KernelConfig(rms_norm="triton", rope="triton", norm_rope="triton" if fused else "ref")
        attn = dspark.init_model("tiny-v4", seed=0, device=DEVICE, dtype=torch.float32, kernels=kernels).layers[0].attn
        x = torch.randn(3, attn.wq_a.weight.shape[1], generator=g).to(DEVICE) if not results else results[False][0]
        cos, sin = attn.rope.cos_sin(torch.tensor([0, 5, 9], device=DEVICE))
        ring = torch.full((6, attn.head_dim), float("nan"), device=DEVICE)
        log.clear(), copies.clear()
        outs = attn.project_qkv(x, cos, sin, kv_out=ring, kv_rows=torch.tensor([4, 0, 2], device=DEVICE))
        results[fused] = (x, *outs, ring, list(log), len(copies))
    _, *ref_outs, ref_ring, ref_log, ref_copies = results[False]
    _, *outs, ring, fused_log, fused_copies = results[True]
    assert sorted(ref_log) == sorted(["_rms_norm_kernel"] * 3 + ["_rope_kernel"] * 2) and ref_copies == 1
    assert sorted(fused_log) == sorted(["_rms_norm_kernel"] + ["_norm_rope_kernel"] * 2) and fused_copies == 0
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
    for r in (ring, ref_ring):
        assert torch.equal(r[[4, 0, 2]], outs[2]) and r[[1, 3, 5]].isnan().all()


@needs_triton
@torch.no_grad()
def test_static_step_stores_the_window_latents_from_the_op(monkeypatch):
    """The V4 static step with norm_rope fused writes every layer's window latents from the kernel (no
    `index_copy_` into a window ring; the reference makes one per layer) and its logits equal the
    reference op's."""
    logits, ring_copies = [], []
    for impl in ("ref", "triton"):
        model = dspark.init_model("tiny-v4", seed=0, device=DEVICE, dtype=torch.float32,
                                  kernels=KernelConfig(norm_rope=impl))
        decoder = StaticDecoder(model, StaticShape(slots=2, max_context=32, tokens=2))
        g = torch.Generator().manual_seed(1)
        starts = []
        for slot, n in enumerate((5, 9)):
            state = model.new_state()
            model(torch.randint(0, 256, (n,), generator=g), [state], [n])
            starts.append(decoder.load(slot, state))
        rings = {layer.window.data.data_ptr() for layer in decoder.state.layers}
        copies = []
        index_copy = torch.Tensor.index_copy_
        monkeypatch.setattr(torch.Tensor, "index_copy_",
                            lambda t, *a: copies.append(t.data_ptr() in rings) or index_copy(t, *a))
        logits.append(decoder.step(*decoder.plan(torch.randint(0, 256, (2, 2), generator=g), starts)))
        monkeypatch.undo()
        ring_copies.append(sum(copies))
    assert ring_copies == [len(model.layers), 0]
    assert torch.allclose(logits[1], logits[0], atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# GPU: v4-mini sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_v4_mini_shapes_on_gpu(n, dtype):
    """H 32, d 512, rd 64: q heads (unweighted) and kv latents (weighted, stored at ring rows) equal
    the fused rms_norm -> rope bit for bit, and rms_norm_ref -> rope_ref within rms_norm's tolerance;
    bf16 outputs almost everywhere bit for bit."""
    for x_shape, table_shape, weighted in (((n, 32, 512), (n, 1, 32), False), ((n, 512), (n, 32), True)):
        x, weight, cos, sin = inputs(x_shape, table_shape, weighted, dtype, seed=n)
        rows = torch.randperm(2 * n, device=DEVICE)[:n]
        out = torch.full((2 * n, 512), float("nan"), dtype=dtype, device=DEVICE)
        dest = dict(out=out, out_rows=rows) if weighted else {}
        y = nr.norm_rope(x, weight, cos, sin, eps=1e-6, **dest)
        ref = nr.norm_rope_ref(x, weight, cos, sin, eps=1e-6)
        assert torch.equal(y, fused_pair(x, weight, cos, sin))
        assert rel_err(y, ref) < TOL[dtype]
        if dtype == torch.bfloat16:
            assert (y != ref).float().mean().item() < 1e-3
        if weighted:
            assert torch.equal(out[rows], y)
