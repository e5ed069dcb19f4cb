"""`linear_rms_norm` (dspark/kernels/linear.py): the attention's q_norm(x·wq_aᵀ) in one `_gemv_kernel`
launch (NORM: the last program to take the ticket normalises every row). Against the two Triton ops it
folds (the `linear` GEMV at the same tiles, then `rms_norm`: bit for bit under the interpreter; on a
GPU within the ops' tolerances) and the torch reference, fp32 and bf16, 1 to 4 rows, N a power of two
and not; the ticket counter back at 0 after every call; the fallbacks to the two ops; argument errors;
the V4 model with the fold on its dynamic path and its static step, logits equal to the unfolded
model's, `q_tickets` outside the state dict."""

import dataclasses

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig, linear_norm_op, triton_available
from dspark.kernels import linear as op
from dspark.kernels import rms_norm as rn

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = DEVICE == "cpu"
# ‖Δ‖/‖ref‖ against the torch reference: the GEMV's summation order (test_linear.py's TOL), then the
# norm's (test_kernels_norm_rope.py's NORM_TOL); bf16 by the outputs' rounding (the interpreter truncates).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
EPS = 1e-6
K = 2048  # the shortest row `gemv_pays` takes
TILES = (64, 1024, 4)  # few programs for the interpreter (8 or 16 here), the last one masked at N = 1000


def make_inputs(rows, n_out, dtype, seed, n_in=K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(n_out, n_in, generator=g) * n_in ** -0.5).to(DEVICE, dtype)
    norm_weight = (1 + 0.1 * torch.randn(n_out, generator=g)).to(DEVICE)  # fp32, as `RMSNorm` keeps it
    return x, weight, norm_weight


def tickets():
    return torch.zeros(1, dtype=torch.int32, device=DEVICE)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def two_ops(x, weight, norm_weight, tiles=None):
    """What the model ran before the fold: the `linear` GEMV, then `rms_norm` (Triton both)."""
    return rn.rms_norm(op.launch_gemv(x, weight, tiles), norm_weight, eps=EPS, out_dtype=x.dtype)


def assert_like_two_ops(y, x, weight, norm_weight, tiles=None):
    unfused, ref = two_ops(x, weight, norm_weight, tiles), op.linear_rms_norm_ref(x, weight, norm_weight, eps=EPS)
    assert y.shape == ref.shape and y.dtype == x.dtype and torch.isfinite(y).all()
    assert rel_err(y, ref) < TOL[x.dtype]
    if INTERPRET:  # one program at a time, the same numpy ops in the same order
        assert torch.equal(y, unfused)
    else:  # the norm's per-row reduction tree may differ from rms_norm's multi-row tiles
        assert rel_err(y, unfused) < TOL[x.dtype]


def record_launches(monkeypatch):
    """The tickets passed to every `launch_linear_rms_norm` from here on (the launches still run)."""
    calls, launch = [], op.launch_linear_rms_norm
    monkeypatch.setattr(op, "launch_linear_rms_norm", lambda *a, **k: calls.append(a[3]) or launch(*a, **k))
    return calls


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n_out", [512, 1000])
def test_one_launch_matches_the_two_ops_and_the_reference(dtype, rows, n_out, poisoned):
    x, weight, norm_weight = make_inputs(rows, n_out, dtype, seed=rows * 10 + n_out)
    counter = tickets()
    with poisoned():
        y = op.launch_linear_rms_norm(x, weight, norm_weight, counter, eps=EPS, tiles=TILES)
    assert_like_two_ops(y, x, weight, norm_weight, TILES)
    assert counter.item() == 0


@needs_triton
@pytest.mark.parametrize("rows,lead", [(1, (1,)), (4, (2, 2))])
def test_the_op_at_its_default_tiles(rows, lead, monkeypatch):
    """`linear_rms_norm` itself: one launch at `gemv_tiles` (64 programs on the interpreter's 2 "SMs"
    at one row), equal to `linear` then `rms_norm`, leading dims kept."""
    x, weight, norm_weight = make_inputs(rows, 512, torch.bfloat16, seed=rows)
    x = x.reshape(*lead, K)
    calls, counter = record_launches(monkeypatch), tickets()
    y = op.linear_rms_norm(x, weight, norm_weight, eps=EPS, tickets=counter)
    assert len(calls) == 1 and calls[0] is counter and counter.item() == 0
    assert y.shape == (*lead, 512)
    unfused = rn.rms_norm(op.linear(x, weight), norm_weight, eps=EPS, out_dtype=x.dtype)
    assert torch.equal(y, unfused) if INTERPRET else rel_err(y, unfused) < TOL[x.dtype]


@needs_triton
def test_tickets_are_zero_after_each_call_and_reuse_gives_the_same_bits(poisoned):
    x, weight, norm_weight = make_inputs(2, 1000, torch.bfloat16, seed=7)
    counter = tickets()
    outs = []
    for tiles in (TILES, TILES, (128, 1024, 4)):  # twice at 16 programs, then at 8: the count resets each time
        with poisoned():
            outs.append(op.launch_linear_rms_norm(x, weight, norm_weight, counter, eps=EPS, tiles=tiles))
        assert counter.item() == 0
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[2], outs[0]) < TOL[torch.bfloat16]


@needs_triton
@pytest.mark.parametrize("rows,n_in,given", [
    (5, K, True),  # more rows than GEMV_MAX_ROWS: torch's matmul, then rms_norm
    (1, 1024, True),  # K below GEMV_MIN_K
    (1, K, False),  # no tickets: no counter to take
])
def test_fallbacks_run_the_two_ops(rows, n_in, given, monkeypatch):
    x, weight, norm_weight = make_inputs(rows, 512, torch.float32, seed=rows + n_in, n_in=n_in)
    calls, counter = record_launches(monkeypatch), tickets()
    y = op.linear_rms_norm(x, weight, norm_weight, eps=EPS, tickets=counter if given else None)
    assert not calls and counter.item() == 0
    assert torch.equal(y, rn.rms_norm(op.linear(x, weight), norm_weight, eps=EPS, out_dtype=x.dtype))
    assert rel_err(y, op.linear_rms_norm_ref(x, weight, norm_weight, eps=EPS)) < TOL[torch.float32]


@needs_triton
def test_autograd_runs_the_references():
    x, weight, norm_weight = make_inputs(1, 512, torch.float32, seed=3)
    weight.requires_grad_(True)
    y = op.linear_rms_norm(x, weight, norm_weight, eps=EPS, tickets=tickets())
    assert torch.equal(y, op.linear_rms_norm_ref(x, weight, norm_weight, eps=EPS))
    y.sum().backward()
    assert weight.grad is not None and torch.isfinite(weight.grad).all()


def test_one_tile_rule(monkeypatch):
    """The launch needs `gemv_pays` and a row that fits one norm tile (N <= 8192)."""
    assert op.linear_norm_pays(1, 512, K) and op.linear_norm_pays(4, 2048, K)
    assert not op.linear_norm_pays(5, 512, K) and not op.linear_norm_pays(1, 512, 1024)
    monkeypatch.setattr(op, "gemv_pays", lambda rows, n_out, n_in: True)
    assert op.linear_norm_pays(1, 8192, K) and not op.linear_norm_pays(1, 8193, K)


@needs_triton
@pytest.mark.parametrize("bad,match", [
    (torch.zeros(1, dtype=torch.int64), "int64"),
    (torch.zeros(1), "float32"),
    (torch.zeros(0, dtype=torch.int32), r"\(0,\)"),
    (torch.zeros(1, dtype=torch.int32, device="meta"), "meta"),
    (0, "got 0"),
])
def test_bad_tickets_raise(bad, match):
    x, weight, norm_weight = make_inputs(1, 512, torch.float32, seed=1)
    if isinstance(bad, torch.Tensor) and bad.device.type != "meta":
        bad = bad.to(DEVICE)
    for call in (lambda: op.linear_rms_norm(x, weight, norm_weight, eps=EPS, tickets=bad),
                 lambda: op.launch_linear_rms_norm(x, weight, norm_weight, bad, eps=EPS)):
        with pytest.raises(ValueError, match=f"tickets must be an int32 zero buffer.*{match}"):
            call()


@needs_triton
def test_bad_shapes_raise():
    x, weight, norm_weight = make_inputs(1, 512, torch.float32, seed=2)
    for fn in (op.linear_rms_norm, op.linear_rms_norm_ref):
        with pytest.raises(ValueError, match=r"norm_weight must be \[N=512\], got \(511,\)"):
            fn(x, weight, norm_weight[:511], eps=EPS, tickets=tickets())
        with pytest.raises(ValueError, match="norm_weight must be"):
            fn(x, weight, None, eps=EPS)
        with pytest.raises(ValueError, match="must match weight"):
            fn(x[:, :100], weight, norm_weight, eps=EPS)
    with pytest.raises(ValueError, match="N <= 8192"):
        op.launch_linear_rms_norm(torch.randn(1, 16, device=DEVICE), torch.randn(8200, 16, device=DEVICE),
                                  torch.ones(8200, device=DEVICE), tickets(), eps=EPS)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        op.launch_linear_rms_norm(torch.randn(9, K, device=DEVICE), torch.randn(16, K, device=DEVICE),
                                  torch.ones(16, device=DEVICE), tickets(), eps=EPS)


# ------------------------------------------------------------------------------------------ model


def folded_kernels(fold: bool) -> KernelConfig:
    """The CPU default (references) with `linear` and `rms_norm` on Triton, the fold on or off."""
    return dataclasses.replace(KernelConfig.for_device(DEVICE), linear="triton", rms_norm="triton",
                               linear_rms_norm="triton" if fold else "ref")


def test_the_model_folds_only_when_the_config_picks_all_three():
    assert linear_norm_op(KernelConfig.uniform("ref")) is None
    for other in (dict(linear="ref"), dict(rms_norm="ref"), dict(linear_rms_norm="ref")):
        assert linear_norm_op(dataclasses.replace(KernelConfig.uniform("triton"), **other)) is None
    if triton_available():
        assert linear_norm_op(KernelConfig.uniform("triton")) is op.linear_rms_norm


def tiny_v4(fold: bool):
    return dspark.init_model("tiny-v4", seed=0, device=DEVICE, dtype=torch.float32, kernels=folded_kernels(fold))


@needs_triton
@torch.no_grad()
def test_model_logits_with_the_fold_equal_the_two_ops(monkeypatch):
    """tiny-v4 fp32 on the dynamic path: a 9-token prefill (the two ops: too many rows), then decode
    steps of one and two requests (the one launch per attention layer, the GEMV's range widened to the
    tiny model's K as test_linear.py does): the same logits bit for bit, every counter back at 0."""
    monkeypatch.setattr(op, "gemv_pays", lambda rows, n_out, n_in: 1 <= rows <= op.GEMV_MAX_ROWS)
    calls = record_launches(monkeypatch)
    logits = []
    for fold in (False, True):
        model = tiny_v4(fold)
        attns = [layer.attn for layer in model.layers]
        assert all(a.q_lora_op is (op.linear_rms_norm if fold else None) for a in attns)
        assert not any("q_tickets" in key for key in model.state_dict())
        calls.clear()
        g = torch.Generator().manual_seed(1)
        states = [model.new_state() for _ in range(2)]
        outs = [model(torch.randint(0, 256, (9,), generator=g), states[:1], [9]).logits[-1:]]
        outs.append(model(torch.randint(0, 256, (5,), generator=g), states[1:], [5]).logits[-1:])
        for _ in range(2):
            outs.append(model(torch.randint(0, 256, (1,), generator=g), states[:1], [1]).logits)  # batch 1
            outs.append(model(torch.randint(0, 256, (2,), generator=g), states, [1, 1]).logits)  # 2 rows
        # every decode call launched the fold once per attention layer, with that layer's own counter
        assert len(calls) == (4 * len(attns) if fold else 0)
        assert {id(t) for t in calls} == ({id(a.q_tickets) for a in attns} if fold else set())
        assert all(a.q_tickets.item() == 0 for a in attns)
        logits.append(torch.cat(outs))
    assert torch.equal(logits[0], logits[1])


@needs_triton
@torch.no_grad()
@pytest.mark.parametrize("family", ["tiny-v4", "tiny-v41"])
def test_static_step_with_the_fold_equals_the_two_ops(family, monkeypatch):
    """The V4 and V4.1 static decode steps at one slot and one token (what `project_q_lora` sees in a
    batch-1 graph step) with and without the fold: the same logits bit for bit."""
    from dspark.models.deepseek_v4.static_state import StaticShape
    from dspark.models.deepseek_v4.static_step import StaticDecoder
    from dspark.models.deepseek_v41.static_step import StaticDecoderV41

    monkeypatch.setattr(op, "gemv_pays", lambda rows, n_out, n_in: 1 <= rows <= op.GEMV_MAX_ROWS)
    calls = record_launches(monkeypatch)
    decoder_cls, options = ((StaticDecoder, {}) if family == "tiny-v4"
                            else (StaticDecoderV41, dict(prefill_mode="exact", cache_qat=False)))
    logits = []
    for fold in (False, True):
        calls.clear()
        model = dspark.init_model(family, seed=0, device=DEVICE, dtype=torch.float32, kernels=folded_kernels(fold),
                                  **options)
        decoder = decoder_cls(model, StaticShape(slots=1, max_context=64, tokens=1))
        state = model.new_state()
        model(torch.arange(3, 10, device=DEVICE), [state], [7])
        starts = torch.tensor([decoder.load(0, state)])
        outs = []
        for token in (5, 9):
            outs.append(decoder.step(*decoder.plan(torch.tensor([[token]]), starts)))
            starts = starts + 1
        assert (len(calls) > 0) == fold
        logits.append(torch.stack(outs))
    assert torch.equal(logits[0], logits[1])


@needs_triton
def test_q_tickets_follow_the_module():
    model = tiny_v4(fold=True)
    attn = model.layers[0].attn
    assert attn.q_tickets.dtype == torch.int32 and attn.q_tickets.shape == (1,) and attn.q_tickets.device.type == DEVICE
    moved = model.to("meta")
    assert moved.layers[0].attn.q_tickets.is_meta


# -------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("n_out,n_in", [(512, 2048), (1024, 4096), (2048, 2048)])  # v4-mini, V4-Flash wq_a; widest N
def test_model_shapes_on_gpu(rows, n_out, n_in):
    """bf16 at the launch tiles of the device: within tolerance of the reference; at one row the two ops'
    bits (the GEMV's explicit FMAs, and the norm on the same [1, BLOCK_D] tile at the same warps as
    `rms_norm`'s one-row launch, contraction off in both: the sm_90 code has the same reduction)."""
    x, weight, norm_weight = make_inputs(rows, n_out, torch.bfloat16, seed=rows + n_out, n_in=n_in)
    counter = tickets()
    y = op.linear_rms_norm(x, weight, norm_weight, eps=EPS, tickets=counter)
    unfused = rn.rms_norm(op.linear(x, weight), norm_weight, eps=EPS, out_dtype=x.dtype)
    assert rel_err(y, op.linear_rms_norm_ref(x, weight, norm_weight, eps=EPS)) < TOL[torch.bfloat16]
    assert torch.equal(y, unfused) if rows == 1 else rel_err(y, unfused) < TOL[torch.bfloat16]
    assert counter.item() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
def test_graph_replays_equal_eager_and_leave_the_counter_at_zero(rows):
    """Captured once, replayed three times on new inputs: each replay equal to the eager op on them."""
    x, weight, norm_weight = make_inputs(rows, 512, torch.bfloat16, seed=rows)
    counter = tickets()

    def step():
        return op.linear_rms_norm(x, weight, norm_weight, eps=EPS, tickets=counter)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert counter.item() == 0
        assert torch.equal(out, step())
