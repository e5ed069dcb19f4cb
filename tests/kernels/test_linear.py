"""Few-row linear (dspark/kernels/linear.py): the Triton GEMV (1 row) and skinny tensor-core kernel
(2..16 rows) against torch's matmul on random inputs, fp32 and bf16, shapes off every tile; the
prefill fallback; autograd; argument errors; the models' `Linear` module on the op."""

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
@pytest.mark.parametrize("lead", [(1,), (1, 1), (2,), (3, 2), (16,)])
@pytest.mark.parametrize("n_out,n_in", [(40, 24), (7, 130), (33, 1500)])  # N, K off the tiles; K > one GEMV tile
def test_linear_matches_ref(dtype, lead, n_out, n_in, poisoned):
    x, weight = make_inputs(lead, n_out, n_in, dtype, seed=n_out * 7 + len(lead))
    with poisoned():
        y = op.linear(x, weight)
    ref = op.linear_ref(x, weight)
    assert y.shape == ref.shape == (*lead, n_out) and y.dtype == dtype
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) < TOL[dtype]


@needs_triton
def test_more_rows_than_a_tile_take_torch(monkeypatch):
    x, weight = make_inputs((op.ROWS_MAX + 1,), 20, 24, torch.float32, seed=1)

    def fail(*args, **kwargs):
        raise AssertionError("a few-row kernel ran for a prefill-sized call")

    monkeypatch.setattr(op, "_gemv_kernel", fail)
    monkeypatch.setattr(op, "_skinny_kernel", fail)
    assert torch.equal(op.linear(x, weight), op.linear_ref(x, weight))


@needs_triton
@pytest.mark.parametrize("n_out,n_in,n_sms", [(512, 2048, 132), (16384, 512, 132), (64, 2048, 132),
                                              (129280, 2048, 132), (5, 3, 2)])
def test_tiles_cover_the_grid_they_claim(n_out, n_in, n_sms):
    """GEMV tiles: 8192-element weight tiles at most, BLOCK_N shrinks until ~2 programs per SM
    (or 1 row); skinny tiles: tl.dot's 16 minimum on every side."""
    block_n, block_k, _ = op.gemv_tiles(n_out, n_in, n_sms)
    assert block_n * block_k <= 8192 and block_k <= 1024
    assert block_n == 1 or -(-n_out // block_n) >= 2 * n_sms or block_n * block_k == 8192
    block_n, block_k, _, _ = op.skinny_tiles(n_out, n_in, n_sms)
    assert 16 <= block_n <= 64 and 16 <= block_k <= 256


@needs_triton
def test_records_grad_runs_torch():
    x, weight = make_inputs((2,), 20, 24, torch.float32, seed=3)
    weight.requires_grad_(True)
    op.linear(x, weight).sum().backward()
    assert weight.grad is not None and torch.allclose(weight.grad, x.sum(0, keepdim=True).expand(20, 24))


def test_bad_arguments_name_the_shapes():
    x, weight = make_inputs((2,), 20, 24, torch.float32, seed=4, device="cpu")
    with pytest.raises(ValueError, match="weight must be"):
        op.linear_ref(x, weight[0])
    with pytest.raises(ValueError, match=r"x \[..., K\] must match"):
        op.linear_ref(x[:, :5], weight)
    with pytest.raises(ValueError, match="share a dtype"):
        op.linear_ref(x.double(), weight)


@needs_triton
@torch.no_grad()
def test_module_runs_the_configured_op():
    """`Linear` keeps nn.Linear's parameter (the checkpoint key) and runs the op its config picks."""
    torch.manual_seed(0)
    fused = Linear(24, 20, dtype=torch.float32, device=DEVICE, kernels=KernelConfig(linear="triton"))
    ref = Linear(24, 20, dtype=torch.float32, device=DEVICE)
    ref.load_state_dict(fused.state_dict())
    assert list(fused.state_dict()) == ["weight"]
    assert fused.linear_op is op.linear and ref.linear_op is op.linear_ref
    x = torch.randn(3, 24, device=DEVICE)
    assert rel_err(fused(x), ref(x)) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n_out,n_in", [(512, 2048), (16384, 512), (8192, 512), (2048, 2048), (64, 2048),
                                        (129280, 2048)])
def test_model_shapes_on_gpu(rows, n_out, n_in):
    """v4-mini's dense projections (wq_a, wq_b, indexer wq_b, wo_b, weights_proj, the LM head), bf16."""
    x, weight = make_inputs((rows,), n_out, n_in, torch.bfloat16, seed=rows)
    assert rel_err(op.linear(x, weight), op.linear_ref(x, weight)) < TOL[torch.bfloat16]
