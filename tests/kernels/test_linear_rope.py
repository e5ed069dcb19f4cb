"""`linear_rope` (dspark/kernels/linear.py): the GEMV with each head's rotary columns rotated in its epilogue
(`launch_gemv(..., rope=...)`) against the two launches it replaces (`launch_gemv`, then `launch_rope`) bit for
bit, and against the torch reference, on random inputs; where `linear_rope` takes the one launch
(`ROPE_EPILOGUE`, `gemv_pays`, `rope_tiles`); argument errors; and the V4 / V4.1 indexers' queries on it."""

import dataclasses

import pytest
import torch

from dspark.kernels import KernelConfig, triton_available
from dspark.kernels import linear as op
from dspark.kernels.rope import launch_rope
from test_linear import indexer_logits_both_ways, record_launches  # tests/kernels is on sys.path (prepend mode)

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # ‖Δ‖/‖ref‖, as test_linear.py


def rope_inputs(rows, n_heads, head_dim, rd, n_in, dtype, seed, device=DEVICE):
    """x [rows, K], weight [H·d, K], cos / sin [rows, rd/2] of random angles (row 0 at position 0: sin 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=g).to(device, dtype)
    weight = (torch.randn(n_heads * head_dim, n_in, generator=g) * n_in ** -0.5).to(device, dtype)
    angles = torch.rand(rows, rd // 2, generator=g) * 6.0
    angles[0] = 0.0
    return x, weight, angles.cos().to(device), angles.sin().to(device)


def two_launches(x, weight, cos, sin, head_dim, tiles=None):
    """What the indexers ran before: the GEMV, then the `rope` kernel on its [N, H, d] view."""
    q = op.launch_gemv(x, weight, tiles).unflatten(-1, (-1, head_dim))
    return launch_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("n_heads,head_dim,rd,n_in,tiles", [
    (4, 16, 8, 40, None),          # the default tiles: BLOCK_N 16, one head a program
    (4, 16, 8, 40, (4, 64, 4)),    # BLOCK_N 4: a head over four programs, the first two unrotated
    (3, 16, 8, 130, (32, 256, 4)), # BLOCK_N 32: two heads a program, the last program half masked
    (2, 8, 8, 24, (2, 32, 4)),     # no unrotated columns, one pair a program
])
def test_rope_epilogue_is_the_two_launches_bit_for_bit(dtype, rows, n_heads, head_dim, rd, n_in, tiles, poisoned):
    x, weight, cos, sin = rope_inputs(rows, n_heads, head_dim, rd, n_in, dtype, seed=rows * 31 + n_in)
    with poisoned():
        y = op.launch_gemv(x, weight, tiles, rope=(cos, sin, head_dim))
    assert y.shape == (rows, n_heads * head_dim) and y.dtype == dtype
    q = y.unflatten(-1, (-1, head_dim))
    assert torch.equal(q, two_launches(x, weight, cos, sin, head_dim, tiles))
    assert rel_err(q, op.linear_rope_ref(x, weight, cos, sin, head_dim=head_dim)) < TOL[dtype]
    assert not torch.equal(q[..., -rd:], x.new_tensor(0).expand_as(q[..., -rd:]))


@needs_triton
@pytest.mark.parametrize("epilogue,rows,n_in,one_launch", [
    (True, 1, 512, True),     # the indexers' decode row: K = 512 runs the GEMV at one row
    (True, 2, 512, False),    # two rows of 512: torch's matmul, then the rope kernel
    (False, 1, 512, False),   # the candidate off: the two launches
])
def test_linear_rope_takes_one_launch_where_the_gemv_pays(epilogue, rows, n_in, one_launch, monkeypatch):
    monkeypatch.setattr(op, "ROPE_EPILOGUE", epilogue)
    x, weight, cos, sin = rope_inputs(rows, 2, 32, 16, n_in, torch.float32, seed=rows + n_in)
    calls = record_launches(monkeypatch, "launch_gemv")
    q = op.linear_rope(x, weight, cos, sin, head_dim=32)
    assert q.shape == (rows, 2, 32)
    assert any(k.get("rope") is not None for k in calls) == one_launch
    assert rel_err(q, op.linear_rope_ref(x, weight, cos, sin, head_dim=32)) < TOL[torch.float32]


@needs_triton
def test_linear_rope_under_autograd_runs_the_reference():
    x, weight, cos, sin = rope_inputs(1, 2, 16, 8, 40, torch.float32, seed=9)
    weight.requires_grad_(True)
    q = op.linear_rope(x, weight, cos, sin, head_dim=16)
    q.square().sum().backward()
    assert weight.grad is not None and torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0


def test_rope_tiles_need_whole_pairs():
    assert op.rope_tiles(16, 128)  # v4-mini's indexer queries at one row: BLOCK_N 16
    assert op.rope_tiles(2, 8)  # one pair a program
    assert not op.rope_tiles(1, 128)  # one column a program splits every pair
    assert not op.rope_tiles(16, 127)  # an odd head_dim starts every other head's pairs on an odd column


def test_bad_arguments_name_the_values():
    x, weight, cos, sin = rope_inputs(2, 2, 16, 8, 24, torch.float32, seed=4, device="cpu")
    with pytest.raises(ValueError, match="head_dim must be a positive int dividing weight's 32 rows, got 5"):
        op.linear_rope_ref(x, weight, cos, sin, head_dim=5)
    with pytest.raises(ValueError, match=r"cos / sin must both be \[N, rd/2\] with N = 2"):
        op.linear_rope_ref(x, weight, cos[:1], sin[:1], head_dim=16)
    with pytest.raises(ValueError, match="rd <= head_dim = 4"):
        op.linear_rope_ref(x, weight, cos, sin, head_dim=4)
    with pytest.raises(ValueError, match=r"x must be \[N, K\]"):
        op.linear_rope_ref(x[None], weight, cos, sin, head_dim=16)


@needs_triton
def test_launch_gemv_rejects_a_rope_it_cannot_take():
    x, weight, cos, sin = rope_inputs(1, 2, 16, 8, 24, torch.float32, seed=6)
    with pytest.raises(ValueError, match="a scale or a rope, not both"):
        op.launch_gemv(x, weight, scale=0.5, rope=(cos, sin, 16))
    with pytest.raises(ValueError, match="even BLOCK_N"):
        op.launch_gemv(x, weight, (1, 32, 4), rope=(cos, sin, 16))


@needs_triton
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
@torch.no_grad()
def test_indexers_on_linear_rope_give_the_same_logits(name, monkeypatch):
    """The V4 and V4.1 indexers' queries through `linear_rope` with the rotation in the GEMV's epilogue (one
    launch) against the path it replaces (each indexer's `wq_b` GEMV, then its `rope_op`): the same bits, so
    the same logits, over a prefill and decode steps (the GEMV's one-row range widened to the tiny K)."""
    monkeypatch.setattr(op, "ROPE_EPILOGUE", True)
    monkeypatch.setattr(op, "gemv_pays", lambda rows, n_out, n_in: 1 <= rows <= op.GEMV_MAX_ROWS)
    calls = record_launches(monkeypatch, "launch_gemv")
    kernels = dataclasses.replace(KernelConfig.for_device(DEVICE), linear="triton", rope="triton",
                                  linear_rope="triton")
    former, fused = indexer_logits_both_ways(name, kernels, "linear_rope_op", op.linear_rope, None, calls,
                                             lambda calls: any(k.get("rope") is not None for k in calls))
    assert torch.equal(former, fused)


def test_indexers_keep_two_ops_unless_linear_and_linear_rope_are_triton():
    import dspark

    for kernels in (KernelConfig(), KernelConfig(linear_rope="triton"), KernelConfig(linear="triton")):
        model = dspark.init_model("tiny-v4", seed=0, device="cpu", dtype=torch.float32, kernels=kernels)
        assert all(m.linear_rope_op is None for m in model.modules() if hasattr(m, "linear_rope_op"))


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,rows", [(64, 1), (32, 1), (64, 2)])
def test_indexer_shapes_on_gpu_bit_for_bit(n_heads, rows):
    """v4-mini's (64 heads) and v41-mini's (32) indexer queries, [Hi·128, 512] bf16, rd 64: the epilogue
    equals the two launches bit for bit (rows 2: a verify pair at the default multi-row tiles)."""
    x, weight, cos, sin = rope_inputs(rows, n_heads, 128, 64, 512, torch.bfloat16, seed=n_heads + rows)
    q = op.launch_gemv(x, weight, rope=(cos, sin, 128)).unflatten(-1, (-1, 128))
    assert torch.equal(q, two_launches(x, weight, cos, sin, 128))
    assert rel_err(q, op.linear_rope_ref(x, weight, cos, sin, head_dim=128)) < TOL[torch.bfloat16]
