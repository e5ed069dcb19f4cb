"""Few-row linear (dspark/kernels/linear.py): the Triton GEMV and compressor projection against torch on
random inputs, fp32 and bf16, shapes off every tile, 1 to 8 rows (each row equal to a one-row launch
on it); which calls `linear` / `compressor_project` send to the kernels and which to torch; autograd;
argument errors; the models' `Linear` and `Compressor` modules."""

import dataclasses

import pytest
import torch

from dspark.kernels import KernelConfig, triton_available
from dspark.kernels import linear as op
from dspark.models.deepseek_v4.linear import Linear

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ‖Δ‖/‖ref‖: fp32 differs by summation order only; bf16 by the output's rounding (1 ulp where the two
# summation orders round apart; the interpreter's fp32 -> bf16 cast truncates, conftest.py).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def make_inputs(lead, n_out, n_in, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n_in, generator=g)
    weight = torch.randn(n_out, n_in, generator=g) * n_in ** -0.5
    return x.to(device, dtype), weight.to(device, dtype)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1,), (1, 1)])
@pytest.mark.parametrize("n_out,n_in", [(40, 24), (7, 130), (33, 1500), (9, 2048)])  # N, K off the tiles; K > a tile
def test_gemv_matches_ref(dtype, lead, n_out, n_in, poisoned):
    x, weight = make_inputs(lead, n_out, n_in, dtype, seed=n_out * 7 + len(lead))
    with poisoned():
        y = op.launch_gemv(x, weight)
    ref = op.linear_ref(x, weight)
    assert y.shape == ref.shape == (*lead, n_out) and y.dtype == dtype
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) < TOL[dtype]


@needs_triton
@pytest.mark.parametrize("tiles", [(1, 16, 4), (4, 256, 4), (8, 1024, 8)])
def test_gemv_any_tiles(tiles, poisoned):
    x, weight = make_inputs((1,), 37, 700, torch.float32, seed=5)
    with poisoned():
        y = op.launch_gemv(x, weight, tiles)
    assert rel_err(y, op.linear_ref(x, weight)) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(2,), (3,), (2, 4)])  # 2, 3 (ROWS 4, a masked row), 8 rows
@pytest.mark.parametrize("n_out,n_in", [(33, 1500), (9, 2048)])
def test_multi_row_gemv_matches_ref_and_one_row_launches(dtype, lead, n_out, n_in, poisoned):
    """Every weight tile times every row: each row within tolerance of torch, and bit-identical to
    the one-row launch on that row (same K tile, same lanes, same reduction order)."""
    x, weight = make_inputs(lead, n_out, n_in, dtype, seed=n_out + 3 * len(lead) + lead[0])
    with poisoned():
        y = op.launch_gemv(x, weight)
        one_by_one = torch.stack([op.launch_gemv(row, weight) for row in x.reshape(-1, n_in)])
    ref = op.linear_ref(x, weight)
    assert y.shape == ref.shape == (*lead, n_out) and y.dtype == dtype and torch.isfinite(y).all()
    assert rel_err(y, ref) < TOL[dtype]
    if dtype == torch.bfloat16 or n_in % 1024 == 0:  # fp32 with a masked K tail: ulps apart on the H200
        assert torch.equal(y.reshape(-1, n_out), one_by_one)


@needs_triton
def test_multi_row_gemv_any_tiles(poisoned):
    x, weight = make_inputs((5,), 37, 700, torch.float32, seed=6)
    for tiles in ((2, 128, 4), (4, 256, 8)):
        with poisoned():
            y = op.launch_gemv(x, weight, tiles)
        assert rel_err(y, op.linear_ref(x, weight)) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("max_rows,lead,kernel", [(8, (4,), True), (8, (2, 4), True), (8, (9,), False),
                                                  (2, (3,), False), (1, (2,), False)])
def test_linear_multi_row_routing_follows_gemv_max_rows(max_rows, lead, kernel, monkeypatch):
    """GEMV_MAX_ROWS (the bench raises it) lets `linear` run the kernel for up to that many rows."""
    monkeypatch.setattr(op, "GEMV_MAX_ROWS", max_rows)
    x, weight = make_inputs(lead, 33, 2048, torch.float32, seed=len(lead))
    calls = []
    launch = op.launch_gemv
    monkeypatch.setattr(op, "launch_gemv", lambda *a: calls.append(a) or launch(*a))
    y = op.linear(x, weight)
    assert bool(calls) == kernel
    assert y.shape == (*lead, 33) and rel_err(y, op.linear_ref(x, weight)) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("lead,n_out,n_in,kernel", [
    ((1,), 33, 2048, True),  # one row, K >= 2048, a small weight: the kernel
    ((1, 1), 2048, 2048, True),
    ((4,), 33, 2048, True),  # up to GEMV_MAX_ROWS (4) rows
    ((5,), 33, 2048, False),  # more than GEMV_MAX_ROWS rows
    ((1,), 33, 1024, False),  # K below 2048
    ((1,), 2049, 2048, False),  # more than 4M elements
    ((1,), 40, 512, True),  # one row of SHORT_K
    ((1, 1), 16384, 512, True),  # v4-mini's wq_b: 8M elements
    ((2,), 40, 512, False),  # SHORT_K rows: one row only
    ((1,), 16385, 512, False),  # more than SHORT_K_MAX_ELEMENTS
    ((1,), 40, 1024, False),  # K = 1024 (V4-Flash's short rows): not timed in a step
])
def test_linear_runs_the_kernel_where_it_won(lead, n_out, n_in, kernel, monkeypatch):
    x, weight = make_inputs(lead, n_out, n_in, torch.float32, seed=n_out)
    calls = []
    launch = op.launch_gemv
    monkeypatch.setattr(op, "launch_gemv", lambda *a: calls.append(a) or launch(*a))
    y = op.linear(x, weight)
    assert bool(calls) == kernel == op.gemv_pays(x.numel() // n_in, n_out, n_in)
    assert y.shape == (*lead, n_out) and rel_err(y, op.linear_ref(x, weight)) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("n_out,n_in,n_sms", [(512, 2048, 132), (16384, 512, 132), (64, 2048, 132),
                                              (129280, 2048, 132), (5, 3, 2)])
def test_gemv_tiles_cover_the_grid_they_claim(n_out, n_in, n_sms):
    """8192-element weight tiles at most, K tiles up to GEMV_K_TILE, BLOCK_N shrinks until ~2 programs per SM."""
    block_n, block_k, _ = op.gemv_tiles(n_out, n_in, n_sms)
    assert block_n * block_k <= 8192 and block_k <= op.GEMV_K_TILE
    assert block_n == 1 or -(-n_out // block_n) >= 2 * n_sms or block_n * block_k == 8192


@needs_triton
@pytest.mark.parametrize("n_out,n_in", [(512, 2048), (2048, 2048), (64, 2048), (1024, 4096), (33, 1500)])
def test_gemv_rows_past_1024_take_one_wide_k_tile_at_every_row_count(n_out, n_in, monkeypatch):
    """With GEMV_K_TILE 2048 (the candidate the bench times), rows of more than 1024 load in 2048-wide
    steps (all of a row of 2048 in one) on the grid of the 1024-wide tiles (BLOCK_N halved, at least 1),
    and BLOCK_K and the warps (so a row's lanes and reduction order) are the same for 1 to 8 rows of x."""
    narrow = {rows: op.gemv_tiles(n_out, n_in, 132, rows) for rows in range(1, op.MAX_ROWS + 1)}
    monkeypatch.setattr(op, "GEMV_K_TILE", 2048)
    wide = {rows: op.gemv_tiles(n_out, n_in, 132, rows) for rows in range(1, op.MAX_ROWS + 1)}
    assert {(block_k, warps) for _, block_k, warps in wide.values()} == {(2048, 8)}
    assert {block_k for _, block_k, _ in narrow.values()} == {1024}
    assert all(wide[rows][0] == max(1, narrow[rows][0] // 2) for rows in wide)



@needs_triton
def test_records_grad_runs_torch():
    x, weight = make_inputs((1,), 20, 2048, torch.float32, seed=3)
    weight.requires_grad_(True)
    op.linear(x, weight).sum().backward()
    assert weight.grad is not None and torch.allclose(weight.grad, x.expand(20, 2048))


def test_bad_arguments_name_the_shapes():
    x, weight = make_inputs((2,), 20, 24, torch.float32, seed=4, device="cpu")
    with pytest.raises(ValueError, match="weight must be"):
        op.linear_ref(x, weight[0])
    with pytest.raises(ValueError, match=r"x \[..., K\] must match"):
        op.linear_ref(x[:, :5], weight)
    with pytest.raises(ValueError, match="share a dtype"):
        op.linear_ref(x.double(), weight)
    with pytest.raises(ValueError, match="1 to 8 rows, got 9"):
        op.launch_gemv(torch.zeros(9, 24), weight)


@needs_triton
@torch.no_grad()
def test_module_runs_the_configured_op():
    """`Linear` keeps nn.Linear's parameter (the checkpoint key) and runs the op its config picks."""
    torch.manual_seed(0)
    fused = Linear(2048, 20, dtype=torch.float32, device=DEVICE, kernels=KernelConfig(linear="triton"))
    ref = Linear(2048, 20, dtype=torch.float32, device=DEVICE)
    ref.load_state_dict(fused.state_dict())
    assert list(fused.state_dict()) == ["weight"]
    assert fused.linear_op is op.linear and ref.linear_op is op.linear_ref
    x = torch.randn(1, 2048, device=DEVICE)
    assert rel_err(fused(x), ref(x)) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,n_out,n_in", [((1,), 64, 2048), ((3,), 32, 130), ((1, 2), 7, 1500)])
def test_linear_scaled_is_the_gemv_rounded_then_scaled(dtype, lead, n_out, n_in, poisoned):
    """`linear_scaled`'s epilogue on the GEMV's own sums: bit for bit the rounded `launch_gemv` output
    cast to fp32 times the scale (what the indexers computed in three launches), fp32 out."""
    x, weight = make_inputs(lead, n_out, n_in, dtype, seed=n_out + n_in)
    scale = (64 * 128) ** -0.5
    with poisoned():
        y = op.launch_gemv(x, weight, scale=scale)
    assert y.dtype == torch.float32 and y.shape == (*lead, n_out)
    assert torch.equal(y, op.launch_gemv(x, weight).float() * scale)
    assert rel_err(y, op.linear_scaled_ref(x, weight, scale=scale)) < TOL[dtype]


@needs_triton
@pytest.mark.parametrize("rows,n_in,kernel", [(1, 2048, True), (4, 2048, True), (5, 2048, False), (1, 1024, False)])
def test_linear_scaled_runs_the_kernel_where_the_gemv_pays(rows, n_in, kernel, monkeypatch):
    x, weight = make_inputs((rows,), 16, n_in, torch.bfloat16, seed=rows)
    calls = record_launches(monkeypatch, "launch_gemv")
    y = op.linear_scaled(x, weight, scale=0.125)
    assert bool(calls) == kernel and y.dtype == torch.float32
    if not kernel:  # the reference: the models' former code, bit for bit
        assert torch.equal(y, torch.nn.functional.linear(x, weight).float() * 0.125)
    with pytest.raises(ValueError, match="share a dtype"):
        op.linear_scaled_ref(x.float(), weight, scale=0.125)


@needs_triton
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
@torch.no_grad()
def test_indexers_on_linear_scaled_give_the_same_logits(name, monkeypatch):
    """The V4 and V4.1 indexers' head weights from `linear_scaled` (one launch) against the path it
    replaced (the registry's `linear` GEMV, then the cast and the product, swapped in as each indexer's
    `weights_op`): the same sums, so the same logits bit for bit, over a prefill and decode steps
    (the GEMV's range widened to the tiny model's K)."""
    monkeypatch.setattr(op, "gemv_pays", lambda rows, n_out, n_in: 1 <= rows <= op.GEMV_MAX_ROWS)
    calls = record_launches(monkeypatch, "launch_gemv")
    kernels = dataclasses.replace(KernelConfig.for_device(DEVICE), linear="triton", linear_scaled="triton")
    former, fused = indexer_logits_both_ways(
        name, kernels, "weights_op", op.linear_scaled, lambda x, weight, *, scale: op.linear(x, weight).float() * scale,
        calls, lambda calls: any(k.get("scale") is not None for k in calls))
    assert torch.equal(former, fused)


def indexer_logits_both_ways(name, kernels, attr, fused_op, former_op, calls, fused_ran) -> tuple:
    """(former, fused) `prefill_and_decode_logits` of tiny `name` (fp32, `kernels`): every indexer's op `attr`
    first swapped for `former_op`, then as the registry picked it (`fused_op`); `fused_ran(calls)` (the
    launches recorded meanwhile) must hold in the second run only."""
    import dspark

    options = dict(prefill_mode="exact", cache_qat=False) if name == "tiny-v41" else {}
    logits = []
    for former in (True, False):
        model = dspark.init_model(name, seed=0, device=DEVICE, dtype=torch.float32, **options, kernels=kernels)
        indexers = [m for m in model.modules() if hasattr(m, attr)]
        assert indexers and all(getattr(m, attr) is fused_op for m in indexers)
        if former:
            for m in indexers:
                setattr(m, attr, former_op)
        calls.clear()
        logits.append(prefill_and_decode_logits(model))
        assert fused_ran(calls) != former
    return tuple(logits)


def prefill_and_decode_logits(model) -> torch.Tensor:
    """[3, V]: the last row's logits of a 9-token prefill, then of two decode steps after it (one request)."""
    state = model.new_state()
    ids = torch.arange(3, 12, device=DEVICE)
    steps = [model(ids, [state], [len(ids)]).logits[-1]]
    for token in (5, 9):
        steps.append(model(torch.tensor([token], device=DEVICE), [state], [1]).logits[-1])
    return torch.stack(steps)


@pytest.mark.gpu
@pytest.mark.parametrize("n_out,n_in", [(512, 2048), (16384, 512), (8192, 512), (2048, 2048), (64, 2048),
                                        (129280, 2048)])
def test_model_shapes_on_gpu(n_out, n_in):
    """v4-mini's dense projections (wq_a, wq_b, indexer wq_b, wo_b, weights_proj, the LM head), bf16."""
    x, weight = make_inputs((1,), n_out, n_in, torch.bfloat16, seed=n_out)
    assert rel_err(op.launch_gemv(x, weight), op.linear_ref(x, weight)) < TOL[torch.bfloat16]
    assert rel_err(op.linear(x, weight), op.linear_ref(x, weight)) < TOL[torch.bfloat16]


def project_inputs(n_rows, width, n_in, rate, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, n_in, generator=g).to(device, dtype)
    wkv, wgate = ((torch.randn(width, n_in, generator=g) * n_in ** -0.5).to(device, dtype) for _ in range(2))
    ape = torch.randn(rate, width, generator=g).to(device)
    phase = torch.randint(0, rate, (n_rows,), generator=g).to(device)
    return x, wkv, wgate, ape, phase


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,n_in", [(24, 40), (7, 1500), (48, 2048)])
def test_compressor_project_kernel_matches_ref(dtype, width, n_in, poisoned):
    """One row: kv in x's dtype, score = the gate rounded to x's dtype + ape[phase] in fp32."""
    args = project_inputs(1, width, n_in, 4, dtype, seed=width + n_in)
    with poisoned():
        kv, score = op.launch_project(*args)
    ref_kv, ref_score = op.compressor_project_ref(*args)
    assert kv.dtype == dtype and score.dtype == torch.float32 and score.shape == ref_score.shape == (1, width)
    assert rel_err(kv, ref_kv) < TOL[dtype]
    assert rel_err(score, ref_score) < TOL[dtype]
    # the bias is the phase's row: moving the phase moves the score by the difference of two ape rows
    other = args[4].remainder(4).add(1).remainder(4)
    _, moved = op.launch_project(*args[:4], other)
    assert torch.allclose(moved - score, args[3][other] - args[3][args[4]], atol=1e-5)


def record_launches(monkeypatch, name):
    """The keyword arguments of every call of `op.<name>` from here on (the launches still run)."""
    calls, launch = [], getattr(op, name)
    monkeypatch.setattr(op, name, lambda *a, **k: calls.append(k) or launch(*a, **k))
    return calls


@needs_triton
@pytest.mark.parametrize("n_rows,n_in,kernel", [(1, 2048, True), (3, 2048, True), (9, 2048, False),
                                                (1, 1024, False)])
def test_compressor_project_runs_the_kernel_where_the_gemv_pays(n_rows, n_in, kernel, monkeypatch):
    args = project_inputs(n_rows, 16, n_in, 4, torch.float32, seed=n_rows)
    calls = record_launches(monkeypatch, "launch_project")
    kv, score = op.compressor_project(*args)
    ref_kv, ref_score = op.compressor_project_ref(*args)
    assert bool(calls) == kernel
    assert rel_err(kv, ref_kv) < TOL[torch.float32] and rel_err(score, ref_score) < TOL[torch.float32]


def test_compressor_project_rejects_bad_arguments():
    x, wkv, wgate, ape, phase = project_inputs(2, 8, 16, 4, torch.float32, seed=1, device="cpu")
    with pytest.raises(ValueError, match="wgate must match"):
        op.compressor_project_ref(x, wkv, wgate[:4], ape, phase)
    with pytest.raises(ValueError, match="ape must be"):
        op.compressor_project_ref(x, wkv, wgate, ape.double(), phase)
    with pytest.raises(ValueError, match="phase must be"):
        op.compressor_project_ref(x, wkv, wgate, ape, phase[:1])
    with pytest.raises(ValueError, match="x must be"):
        op.compressor_project_ref(x[None], wkv, wgate, ape, phase)


def ring_destination(n_rows, width, dtype, seed):
    """Poisoned rings (NaN) of n_rows + 6 rows viewed as rows, and n_rows distinct rows of them."""
    g = torch.Generator().manual_seed(seed)
    kv_out = torch.full((n_rows + 6, width), float("nan"), dtype=dtype, device=DEVICE)
    score_out = torch.full((n_rows + 6, width), float("nan"), device=DEVICE)
    return kv_out, score_out, torch.randperm(n_rows + 6, generator=g)[:n_rows].to(DEVICE)


def assert_rows_written(kv_out, score_out, rows, ref_kv, ref_score, tol):
    """The named rows hold the reference's rows; every other row kept its NaN poison."""
    untouched = torch.ones(kv_out.shape[0], dtype=torch.bool, device=kv_out.device)
    untouched[rows] = False
    assert kv_out[untouched].isnan().all() and score_out[untouched].isnan().all()
    assert rel_err(kv_out[rows], ref_kv) < tol and rel_err(score_out[rows], ref_score) < tol


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,n_in", [(24, 40), (48, 2048)])
def test_compressor_project_kernel_stores_at_its_ring_row(dtype, width, n_in, poisoned):
    """With destinations the kernel writes kv and score straight at out_rows[0] of the two rings."""
    args = project_inputs(1, width, n_in, 4, dtype, seed=width + 1)
    kv_out, score_out, rows = ring_destination(1, width, dtype, seed=width)
    with poisoned():
        got = op.launch_project(*args, kv_out=kv_out, score_out=score_out, out_rows=rows)
    assert got[0] is kv_out and got[1] is score_out
    assert_rows_written(kv_out, score_out, rows, *op.compressor_project_ref(*args), TOL[dtype])


@needs_triton
@pytest.mark.parametrize("n_rows,n_in,kernel", [(1, 2048, True), (3, 2048, True), (9, 2048, False),
                                                (1, 1024, False)])
def test_compressor_project_destination_on_both_paths(n_rows, n_in, kernel, monkeypatch):
    """The op's destinations wherever it runs: the kernel stores them, the reference copies them."""
    args = project_inputs(n_rows, 16, n_in, 4, torch.float32, seed=n_rows + 7)
    kv_out, score_out, rows = ring_destination(n_rows, 16, torch.float32, seed=n_rows)
    calls = record_launches(monkeypatch, "launch_project")
    op.compressor_project(*args, kv_out=kv_out, score_out=score_out, out_rows=rows)
    assert bool(calls) == kernel
    assert_rows_written(kv_out, score_out, rows, *op.compressor_project_ref(*args), TOL[torch.float32])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rows", [2, 3, 8])
@pytest.mark.parametrize("width,n_in", [(24, 40), (7, 1500)])
def test_multi_row_project_matches_ref_and_one_row_launches(dtype, n_rows, width, n_in, poisoned):
    """Several rows, each at its own phase: within tolerance of the reference, each row bit-identical
    to the one-row launch on it; with destinations every row lands at its ring row, the rest untouched."""
    args = project_inputs(n_rows, width, n_in, 4, dtype, seed=n_rows * 11 + width)
    with poisoned():
        kv, score = op.launch_project(*args)
        singles = [op.launch_project(args[0][i:i + 1], *args[1:4], args[4][i:i + 1]) for i in range(n_rows)]
    ref_kv, ref_score = op.compressor_project_ref(*args)
    assert kv.shape == score.shape == (n_rows, width) and kv.dtype == dtype and score.dtype == torch.float32
    assert rel_err(kv, ref_kv) < TOL[dtype] and rel_err(score, ref_score) < TOL[dtype]
    if dtype == torch.bfloat16 or n_in % 1024 == 0 or n_in < 1024:  # fp32, masked K tail: ulps apart on the H200
        assert torch.equal(kv, torch.cat([s[0] for s in singles]))
        assert torch.equal(score, torch.cat([s[1] for s in singles]))
    kv_out, score_out, rows = ring_destination(n_rows, width, dtype, seed=n_rows)
    with poisoned():
        op.launch_project(*args, kv_out=kv_out, score_out=score_out, out_rows=rows)
    assert_rows_written(kv_out, score_out, rows, ref_kv, ref_score, TOL[dtype])
    assert torch.equal(kv_out[rows], kv) and torch.equal(score_out[rows], score)


@needs_triton
def test_compressor_project_at_four_rows_launches_the_kernel(monkeypatch):
    """A verify block of 4 rows: one `_project_kernel` launch of ROWS 4, no reference op."""
    args = project_inputs(4, 16, 2048, 4, torch.float32, seed=12)
    kv_out, score_out, rows = ring_destination(4, 16, torch.float32, seed=5)
    want = op.compressor_project_ref(*args)
    launches = []
    kernel = op._project_kernel

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append(k["ROWS"]) or kernel[grid](*a, **k)

    monkeypatch.setattr(op, "_project_kernel", Recorder())
    monkeypatch.setattr(op, "compressor_project_ref", lambda *a, **k: pytest.fail("ran the reference"))
    op.compressor_project(*args, kv_out=kv_out, score_out=score_out, out_rows=rows)
    assert launches == [4]
    assert_rows_written(kv_out, score_out, rows, *want, TOL[torch.float32])


def test_compressor_project_destination_is_validated():
    args = project_inputs(2, 8, 16, 4, torch.float32, seed=1, device="cpu")
    kv_out, score_out, rows = torch.zeros(5, 8), torch.zeros(5, 8), torch.tensor([0, 3])
    with pytest.raises(ValueError, match="go together"):
        op.compressor_project_ref(*args, kv_out=kv_out, out_rows=rows)
    with pytest.raises(ValueError, match="kv_out must be"):
        op.compressor_project_ref(*args, kv_out=kv_out[:, :4], score_out=score_out, out_rows=rows)
    with pytest.raises(ValueError, match="score_out must be"):
        op.compressor_project_ref(*args, kv_out=kv_out, score_out=score_out.double(), out_rows=rows)
    with pytest.raises(ValueError, match="out_rows must be"):
        op.compressor_project_ref(*args, kv_out=kv_out, score_out=score_out, out_rows=rows[:1])


def pair_inputs(n_rows, width, n_in, dtype, seed):
    x, wkv, wgate, _, _ = project_inputs(n_rows, width, n_in, 1, dtype, seed)
    return x, wkv, wgate


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_rows,width,n_in", [(1, 24, 40), (1, 7, 1500), (3, 48, 2048), (8, 16, 100)])
def test_compressor_project_fp32_kernel_matches_ref(dtype, n_rows, width, n_in, poisoned):
    """V4.1's pair: both outputs fp32 and unrounded (bf16 products are exact in fp32, so bf16 inputs
    differ from the reference by summation order only), no position bias; ring stores at out_rows."""
    args = pair_inputs(n_rows, width, n_in, dtype, seed=width + n_in)
    ref_kv, ref_gate = op.compressor_project_fp32_ref(*args)
    with poisoned():
        kv, gate = op.launch_project_fp32(*args)
    assert kv.dtype == gate.dtype == torch.float32 and kv.shape == gate.shape == (n_rows, width)
    assert rel_err(kv, ref_kv) < TOL[torch.float32] and rel_err(gate, ref_gate) < TOL[torch.float32]
    kv_out, gate_out, rows = ring_destination(n_rows, width, torch.float32, seed=n_rows)
    with poisoned():
        got = op.launch_project_fp32(*args, kv_out=kv_out, gate_out=gate_out, out_rows=rows)
    assert got[0] is kv_out and got[1] is gate_out
    assert_rows_written(kv_out, gate_out, rows, ref_kv, ref_gate, TOL[torch.float32])


@needs_triton
@pytest.mark.parametrize("n_rows,n_in,kernel", [(1, 2048, True), (4, 2048, True), (9, 2048, False),
                                                (1, 1024, False)])
def test_compressor_project_fp32_runs_the_kernel_where_the_gemv_pays(n_rows, n_in, kernel, monkeypatch):
    """Where `project_pays` the kernel stores the rows, elsewhere the reference copies them; the
    reference is the model's former code, bit for bit."""
    args = pair_inputs(n_rows, 16, n_in, torch.bfloat16, seed=n_rows + 3)
    x, wkv, wgate = args
    former = (torch.nn.functional.linear(x.float(), wkv.float()), torch.nn.functional.linear(x.float(), wgate.float()))
    ref = op.compressor_project_fp32_ref(*args)
    assert all(torch.equal(a, b) for a, b in zip(ref, former))
    kv_out, gate_out, rows = ring_destination(n_rows, 16, torch.float32, seed=n_rows)
    calls = record_launches(monkeypatch, "launch_project_fp32")
    op.compressor_project_fp32(*args, kv_out=kv_out, gate_out=gate_out, out_rows=rows)
    assert bool(calls) == kernel
    assert_rows_written(kv_out, gate_out, rows, *ref, TOL[torch.float32])


def test_compressor_project_fp32_rejects_bad_arguments():
    x, wkv, wgate = pair_inputs(2, 8, 16, torch.bfloat16, seed=1)
    x, wkv, wgate = x.cpu(), wkv.cpu(), wgate.cpu()
    out, rows = torch.empty(5, 8), torch.tensor([0, 3])
    with pytest.raises(ValueError, match="wgate must match"):
        op.compressor_project_fp32_ref(x, wkv, wgate[:4])
    with pytest.raises(ValueError, match="x must be"):
        op.compressor_project_fp32_ref(x[None], wkv, wgate)
    with pytest.raises(ValueError, match="share a dtype"):
        op.compressor_project_fp32_ref(x.float(), wkv, wgate)
    with pytest.raises(ValueError, match="go together"):
        op.compressor_project_fp32_ref(x, wkv, wgate, kv_out=out, out_rows=rows)
    with pytest.raises(ValueError, match=r"gate_out must be \[R, 8\] torch.float32"):
        op.compressor_project_fp32_ref(x, wkv, wgate, kv_out=out, gate_out=out.bfloat16(), out_rows=rows)
    with pytest.raises(ValueError, match=r"out_rows must be long \[2\]"):
        op.compressor_project_fp32_ref(x, wkv, wgate, kv_out=out, gate_out=out, out_rows=rows.int())


@needs_triton
@torch.no_grad()
def test_compressor_module_on_the_fused_projection():
    """`Compressor.project` of a 2048-wide model (one decode row: the kernel) equals the reference module's."""
    from dspark.models.deepseek_v4.compressor import Compressor

    torch.manual_seed(0)
    kw = dict(overlap=True, eps=1e-6, dtype=torch.float32, device=DEVICE)
    fused = Compressor(2048, 16, 4, kernels=KernelConfig(compressor_project="triton"), **kw)
    ref = Compressor(2048, 16, 4, **kw)
    with torch.no_grad():
        for p in fused.parameters():
            p.normal_()
    ref.load_state_dict(fused.state_dict())
    x, positions = torch.randn(1, 2048, device=DEVICE), torch.tensor([13], device=DEVICE)
    for got, want in zip(fused.project(x, positions), ref.project(x, positions)):
        assert rel_err(got, want) < TOL[torch.float32]


@needs_triton
@torch.no_grad()
def test_compressor_module_projects_into_rings(monkeypatch):
    """`Compressor.project_rows` of a 2048-wide model: one decode row through the kernel (which stores
    it: no copy after), equal to the reference module's rows; the rest of the rings untouched."""
    from dspark.models.deepseek_v4.compressor import Compressor

    torch.manual_seed(1)
    kw = dict(overlap=True, eps=1e-6, dtype=torch.float32, device=DEVICE)
    fused = Compressor(2048, 16, 4, kernels=KernelConfig(compressor_project="triton"), **kw)
    for p in fused.parameters():
        p.normal_()
    x, phase = torch.randn(1, 2048, device=DEVICE), torch.tensor([3], device=DEVICE)
    kv_out, score_out, rows = ring_destination(1, 32, torch.float32, seed=4)
    copies = []
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda *a: copies.append(a))
    fused.project_rows(x, phase, kv_out, score_out, rows)
    assert not copies
    monkeypatch.undo()
    ref = op.compressor_project_ref(x, fused.wkv.weight, fused.wgate.weight, fused.ape, phase)
    assert_rows_written(kv_out, score_out, rows, *ref, TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("width,n_in", [(1024, 2048), (256, 2048), (512, 2048), (1024, 4096)])
def test_compressor_project_model_shapes_on_gpu(width, n_in):
    """v4-mini's compressors, W = CSA 2·512 (overlapped), its indexer's 2·128, HCA 512; V4-Flash's CSA; bf16."""
    args = project_inputs(1, width, n_in, 4, torch.bfloat16, seed=width)
    for got, want in zip(op.launch_project(*args), op.compressor_project_ref(*args)):
        assert rel_err(got, want) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("width,n_in", [(1024, 2048), (256, 2048), (512, 2048)])
def test_compressor_project_into_rings_model_shapes_on_gpu(width, n_in):
    """v4-mini's compressors at batch 1: the row stored in poisoned rings, the rest untouched; bf16."""
    args = project_inputs(1, width, n_in, 4, torch.bfloat16, seed=width + 3)
    kv_out, score_out, rows = ring_destination(1, width, torch.bfloat16, seed=width)
    op.compressor_project(*args, kv_out=kv_out, score_out=score_out, out_rows=rows)
    assert_rows_written(kv_out, score_out, rows, *op.compressor_project_ref(*args), TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("k_tile", [1024, 2048])  # GEMV_K_TILE as shipped and as the bench's candidate
@pytest.mark.parametrize("rows", [2, 4, 8])
@pytest.mark.parametrize("n_out,n_in", [(512, 2048), (2048, 2048), (64, 2048), (1024, 4096), (16384, 512)])
def test_multi_row_gemv_model_shapes_on_gpu(rows, n_out, n_in, k_tile, monkeypatch):
    """v4-mini wq_a / wo_b / weights_proj, V4-Flash wq_a, v4-mini wq_b (K 512), bf16, 2-8 rows: within
    tolerance of torch and each row bit-identical to the one-row launch on it."""
    monkeypatch.setattr(op, "GEMV_K_TILE", k_tile)
    x, weight = make_inputs((rows,), n_out, n_in, torch.bfloat16, seed=n_out + rows)
    y = op.launch_gemv(x, weight)
    assert rel_err(y, op.linear_ref(x, weight)) < TOL[torch.bfloat16]
    for i in range(rows):
        assert torch.equal(y[i], op.launch_gemv(x[i:i + 1], weight)[0]), i


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 4, 8])
@pytest.mark.parametrize("width,n_in", [(1024, 2048), (256, 2048), (512, 2048), (1024, 4096)])
def test_multi_row_project_into_rings_model_shapes_on_gpu(rows, width, n_in):
    """The compressors of a verify block (4 tokens) or a few requests: every row at its ring row and
    bit-identical to the one-row launch on it, the rest of the rings untouched; bf16."""
    args = project_inputs(rows, width, n_in, 4, torch.bfloat16, seed=width + rows)
    kv_out, score_out, out_rows = ring_destination(rows, width, torch.bfloat16, seed=width)
    op.launch_project(*args, kv_out=kv_out, score_out=score_out, out_rows=out_rows)
    assert_rows_written(kv_out, score_out, out_rows, *op.compressor_project_ref(*args), TOL[torch.bfloat16])
    for i in range(rows):
        kv, score = op.launch_project(args[0][i:i + 1], *args[1:4], args[4][i:i + 1])
        assert torch.equal(kv_out[out_rows[i]], kv[0]) and torch.equal(score_out[out_rows[i]], score[0]), i
