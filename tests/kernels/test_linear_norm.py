"""`linear_norm` (dspark/kernels/linear.py): V4's q_norm folded into the wq_b GEMV. The kernel against the
pair it replaces (`rms_norm`, then the GEMV) and the torch reference on random inputs, fp32 and bf16, K
off the tiles and over two K tiles, 1 to 8 rows; where the op folds and where it runs the pair; the
registry's rule; argument errors; and the V4 / V4.1 static decode steps with the fold against the same
models without it (on CPU the Triton interpreter, conftest.py)."""

import dataclasses

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig, registry, triton_available
from dspark.kernels import linear as op
from dspark.kernels.rms_norm import rms_norm
from dspark.models.deepseek_v4.static_state import StaticShape
from dspark.models.deepseek_v4.static_step import StaticDecoder
from dspark.models.deepseek_v41.static_step import StaticDecoderV41

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ‖Δ‖/‖ref‖, as test_linear.py: summation order in fp32; in bf16 the output's rounding, and here the
# normalised x's (1 ulp where the statistic's sum rounds apart from `rms_norm`'s).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def inputs(rows: int, n_out: int, n_in: int, dtype: torch.dtype, seed: int):
    """x [rows, K] with rows of different scales (so every row has its own statistic), a norm weight
    [K] fp32 away from 1, weight [N, K]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=g) * (torch.rand(rows, 1, generator=g) * 4 + 0.5)
    norm_weight = torch.rand(n_in, generator=g) + 0.5
    weight = torch.randn(n_out, n_in, generator=g) * n_in ** -0.5
    return x.to(DEVICE, dtype), norm_weight.to(DEVICE), weight.to(DEVICE, dtype)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])  # 3: a masked row of ROWS 4
@pytest.mark.parametrize("n_out,n_in", [(40, 24), (33, 512), (9, 1500)])  # 1500: two K tiles, a masked tail
def test_the_folded_gemv_is_the_norm_then_the_gemv(dtype, rows, n_out, n_in, poisoned):
    x, norm_weight, weight = inputs(rows, n_out, n_in, dtype, seed=rows * 31 + n_in)
    eps = 1e-6
    with poisoned():
        y = op.launch_gemv(x, weight, norm=(norm_weight, eps))
    assert y.shape == (rows, n_out) and y.dtype == dtype and torch.isfinite(y).all()
    pair = op.launch_gemv(rms_norm(x, norm_weight, eps=eps, out_dtype=dtype), weight)
    assert rel_err(y, pair) < TOL[dtype]
    assert rel_err(y, op.linear_norm_ref(x, norm_weight, weight, eps=eps)) < TOL[dtype]
    assert rel_err(op.launch_gemv(x, weight), pair) > 0.1  # the norm did change the input


@needs_triton
def test_each_row_is_its_own_one_row_launch(poisoned):
    """The statistic is per row: a row's output does not depend on the launch's other rows."""
    x, norm_weight, weight = inputs(4, 48, 512, torch.bfloat16, seed=3)
    with poisoned():
        y = op.launch_gemv(x, weight, norm=(norm_weight, 1e-6))
    for i in range(4):
        assert torch.equal(y[i], op.launch_gemv(x[i:i + 1], weight, norm=(norm_weight, 1e-6))[0])


def record(monkeypatch, name):
    """The keyword arguments of every call of `op.<name>` from here on (the calls still run)."""
    calls, fn = [], getattr(op, name)
    monkeypatch.setattr(op, name, lambda *a, **k: calls.append(k) or fn(*a, **k))
    return calls


@needs_triton
@pytest.mark.parametrize("rows,n_in,folds", [(1, 512, True), (2, 512, False), (1, 2048, True), (4, 2048, True),
                                             (5, 2048, False), (1, 1024, False)])
def test_linear_norm_folds_where_the_gemv_pays(rows, n_in, folds, monkeypatch):
    """One GEMV launch with the norm where `linear` would run the GEMV (`gemv_pays`: K = 512 at one row,
    K >= 2048 up to 4 rows); elsewhere `rms_norm`, then `linear`, bit for bit."""
    x, norm_weight, weight = inputs(rows, 16, n_in, torch.bfloat16, seed=rows + n_in)
    launches = record(monkeypatch, "launch_gemv")
    y = op.linear_norm(x, norm_weight, weight, eps=1e-6)
    assert [k.get("norm") is not None for k in launches] == ([True] if folds else [False] * bool(launches))
    if not folds:
        assert torch.equal(y, op.linear(rms_norm(x, norm_weight, eps=1e-6, out_dtype=x.dtype), weight))


def test_bad_arguments_name_the_values():
    x, weight = torch.randn(1, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match=r"norm_weight must be a float \[K\] = \[64\].*\(32,\)"):
        op.linear_norm_ref(x, torch.ones(32), weight, eps=1e-6)
    with pytest.raises(ValueError, match="norm_weight must be a float"):
        op.linear_norm_ref(x, torch.ones(64, dtype=torch.int32), weight, eps=1e-6)
    with pytest.raises(ValueError, match="must match weight"):
        op.linear_norm_ref(torch.randn(1, 63), torch.ones(63), weight, eps=1e-6)


def test_the_model_folds_only_with_all_three_kernels():
    """`registry.linear_norm_op`: the kernel only where `linear_norm`, `linear` and `rms_norm` are all Triton
    (elsewhere the model keeps its RMSNorm and Linear); the device default keeps it off until its GPU run."""
    three = dict(linear_norm="triton", linear="triton", rms_norm="triton")
    assert registry.linear_norm_op(KernelConfig()) is None
    for op_name in three:
        assert registry.linear_norm_op(KernelConfig(**{**three, op_name: "ref"})) is None
    if triton_available():
        assert registry.linear_norm_op(KernelConfig(**three)) is op.linear_norm
    assert KernelConfig.for_device("cuda").linear_norm == "ref"  # registry.NOT_YET_ON_GPU


def static_logits(name: str, fold: bool, slots: int, tokens: int, monkeypatch) -> tuple[torch.Tensor, list, int]:
    """Three static decode steps of `name` (fp32, seed 0) after prefills, with the linear and rms_norm
    kernels and `linear_norm` on Triton (fold) or its reference (no fold): their logits, the
    `launch_gemv` calls' norm weights, and how many `rms_norm` launches normalised with a q_norm weight."""
    from dspark.kernels import rms_norm as norm_module

    normed, launch_norm = [], norm_module.rms_norm
    monkeypatch.setattr(norm_module, "rms_norm", lambda x, w, **kw: normed.append(w) or launch_norm(x, w, **kw))
    kernels = dataclasses.replace(KernelConfig.for_device(DEVICE), linear="triton", rms_norm="triton",
                                  linear_norm="triton" if fold else "ref")
    options = dict(prefill_mode="exact", cache_qat=False) if name == "tiny-v41" else {}
    model = dspark.init_model(name, seed=0, device=DEVICE, dtype=torch.float32, kernels=kernels, **options)
    decoder = (StaticDecoderV41 if name == "tiny-v41" else StaticDecoder)(
        model, StaticShape(slots=slots, max_context=48, tokens=tokens))
    g = torch.Generator().manual_seed(4)
    starts = []
    for slot, n in enumerate((9, 5, 13)[:slots]):
        state = model.new_state()
        model(torch.randint(0, 256, (n,), generator=g, device=DEVICE), [state], [n])
        starts.append(decoder.load(slot, state))
    starts = torch.tensor(starts)
    launches = record(monkeypatch, "launch_gemv")
    normed.clear()
    outs = []
    for _ in range(3):
        outs.append(decoder.step(*decoder.plan(torch.randint(0, 256, (slots, tokens), generator=g), starts)))
        starts = starts + tokens
    q_norms = {id(layer.attn.q_norm.weight) for layer in model.layers}
    return (torch.stack(outs), [k["norm"][0] for k in launches if k.get("norm") is not None],
            sum(id(w) in q_norms for w in normed))


@needs_triton
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
@pytest.mark.parametrize("slots,tokens", [(1, 1), (2, 2)])
@torch.no_grad()
def test_static_steps_with_the_fold_follow_the_unfolded_model(name, slots, tokens, monkeypatch):
    """The static step (batch-1 decode; 2 slots × 2-token verify blocks) with q_norm folded into wq_b against
    the same weights with the fold off (RMSNorm, then Linear): the same logits to fp32 summation order,
    and every layer's wq_b launch and every indexer's took the attention's q_norm (the tiny models' K is
    widened into the GEMV's range)."""
    monkeypatch.setattr(op, "gemv_pays", lambda rows, n_out, n_in: 1 <= rows <= op.GEMV_MAX_ROWS)
    off, unfolded, q_norm_launches = static_logits(name, False, slots, tokens, monkeypatch)
    on, folded, q_norm_launches_folded = static_logits(name, True, slots, tokens, monkeypatch)
    torch.testing.assert_close(on, off, atol=2e-4, rtol=1e-4)
    assert not unfolded and q_norm_launches_folded == 0  # the q_norm launches left the step
    model = dspark.init_model(name, seed=0, dtype=torch.float32)
    q_norms = {layer.attn.q_norm.weight.shape for layer in model.layers}
    indexers = sum(layer.attn.indexer is not None for layer in model.layers)
    assert indexers and len(folded) == 3 * (len(model.layers) + indexers) and {w.shape for w in folded} == q_norms
    assert q_norm_launches == 3 * len(model.layers)  # unfolded: once a step per layer, shared with its indexer
