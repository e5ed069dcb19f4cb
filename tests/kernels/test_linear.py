"""One-row linear (dspark/kernels/linear.py): the Triton GEMV against torch's matmul on random inputs,
fp32 and bf16, shapes off every tile; which calls `linear` sends to it (one row, the weights where it
won on the H200) and which to torch; autograd; argument errors; the models' `Linear` module."""

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
@pytest.mark.parametrize("lead,n_out,n_in,kernel", [
    ((1,), 33, 2048, True),  # one row, K >= 2048, a small weight: the kernel
    ((1, 1), 2048, 2048, True),
    ((2,), 33, 2048, False),  # more than one row
    ((1,), 33, 1024, False),  # K below 2048
    ((1,), 2049, 2048, False),  # more than 4M elements
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
    """8192-element weight tiles at most, K tiles up to 1024, BLOCK_N shrinks until ~2 programs per SM."""
    block_n, block_k, _ = op.gemv_tiles(n_out, n_in, n_sms)
    assert block_n * block_k <= 8192 and block_k <= 1024
    assert block_n == 1 or -(-n_out // block_n) >= 2 * n_sms or block_n * block_k == 8192


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
    with pytest.raises(ValueError, match="one row"):
        op.launch_gemv(x, weight)


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


@pytest.mark.gpu
@pytest.mark.parametrize("n_out,n_in", [(512, 2048), (16384, 512), (8192, 512), (2048, 2048), (64, 2048),
                                        (129280, 2048)])
def test_model_shapes_on_gpu(n_out, n_in):
    """v4-mini's dense projections (wq_a, wq_b, indexer wq_b, wo_b, weights_proj, the LM head), bf16."""
    x, weight = make_inputs((1,), n_out, n_in, torch.bfloat16, seed=n_out)
    assert rel_err(op.launch_gemv(x, weight), op.linear_ref(x, weight)) < TOL[torch.bfloat16]
    assert rel_err(op.linear(x, weight), op.linear_ref(x, weight)) < TOL[torch.bfloat16]
