"""Inverse RoPE + grouped `wo_a` (dspark/kernels/grouped_wo_a.py): fused Triton vs the torch reference,
and the reference vs the models' previous code (apply_rope, then the einsum over a [N, G, K] view).

Tiny shapes: ragged N (1, 3, 17: partial M tiles), G ∈ {1, 2, 4}, fp32 and bf16; one head width
that the K tile divides (the kernel rotates only the tiles that reach the rotary dims) and ones it
does not (every tile rotated under masks); a tensor-parallel row block of `wo_a`.
"""

import pytest
import torch

from dspark.kernels import grouped_wo_a as op
from dspark.kernels import triton_available
from dspark.models.deepseek_v4.rope import apply_rope

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ‖Δ‖/‖ref‖: fp32 differs by summation order only; bf16 by 1 ulp where the interpreter's fp32 -> bf16
# cast truncates (conftest.py) or, on the GPU, where the two summation orders round apart.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def make_inputs(n, heads, head_dim, rd, groups, rank, dtype, seed, device=DEVICE):
    """Attention output, cos/sin of positions up to ~1e4 (angles of many turns), wo_a ~ N(0, 1/K)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, heads, head_dim, generator=g)
    positions = torch.randint(0, 10000, (n,), generator=g).float()
    angles = positions[:, None] * torch.rand(rd // 2, generator=g)  # [N, rd/2]
    width = heads * head_dim // groups
    weight = torch.randn(groups * rank, width, generator=g) * width ** -0.5
    return out.to(device, dtype), angles.cos().to(device), angles.sin().to(device), weight.to(device, dtype)


def previous_project_out(out, cos, sin, weight, groups, rank):
    """The models' code before the op: LatentAttention.project_out up to wo_b's input."""
    out = apply_rope(out, cos.unsqueeze(-2), -sin.unsqueeze(-2))
    o = out.reshape(out.shape[0], groups, -1)
    return torch.einsum("ngk,grk->ngr", o, weight.view(groups, rank, -1)).flatten(1)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


SHAPES = [  # (heads, head_dim, rd, rank): d 32 and 48 are not multiples of the K tile, 128 is
    (4, 32, 8, 24),
    (4, 48, 16, 16),
    (4, 128, 16, 16),
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_wo_a_matches_ref(dtype, n, groups, poisoned):
    heads, head_dim, rd, rank = SHAPES[(n + groups) % len(SHAPES)]
    out, cos, sin, weight = make_inputs(n, heads, head_dim, rd, groups, rank, dtype, seed=n * 10 + groups)
    with poisoned():
        y = op.grouped_wo_a(out, cos, sin, weight)
    ref = op.grouped_wo_a_ref(out, cos, sin, weight)
    assert y.shape == (n, groups * rank) and y.dtype == dtype and not y.isnan().any()
    assert rel_err(y, ref) < TOL[dtype]


@needs_triton
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 5])
def test_head_splits_sum_to_the_same_projection(splits, n, poisoned):
    """Decode launches split each group's heads into runs whose fp32 partials a second launch adds:
    the aligned layout (head_dim 64 = 48 nope + rd 16), 8 heads in 2 groups of 4."""
    out, cos, sin, weight = make_inputs(n, 8, 64, 16, 2, 32, torch.bfloat16, seed=splits + n)
    tiles = op.Tiles(16, 16, 16, 4, 2, splits)
    with poisoned():
        y = op.launch_grouped_wo_a(out, cos, sin, weight, tiles)
    assert y.dtype == torch.bfloat16 and not y.isnan().any()
    assert rel_err(y, op.grouped_wo_a_ref(out, cos, sin, weight)) < TOL[torch.bfloat16]


@needs_triton
def test_head_splits_must_divide_the_group():
    out, cos, sin, weight = make_inputs(1, 8, 64, 16, 2, 32, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="splits=3"):
        op.launch_grouped_wo_a(out, cos, sin, weight, op.Tiles(16, 16, 16, 4, 2, 3))


@needs_triton
def test_decode_sizes_split_the_heads_prefill_does_not():
    mini, flash = (4, 512, 8, 512, 64), (8, 1024, 8, 512, 64)  # groups, rank, heads per group, d, rd
    assert op.default_tiles(1, *mini, torch.bfloat16).splits == 4
    assert op.default_tiles(8, *flash, torch.bfloat16).splits == 2
    assert op.default_tiles(300, *mini, torch.bfloat16).splits == 1
    assert op.default_tiles(1, *mini, torch.float32).splits == 1  # fp32: ieee dots, small tiles
    assert op.default_tiles(1, 4, 512, 6, 512, 64, torch.bfloat16).splits == 1  # 4 does not divide 6 heads


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_tiles_and_the_rotation_matter(dtype, poisoned):
    """N = 70 takes the middle tile class (K tile 64 divides d = 128: the aligned path). Without the
    inverse rotation the result would be far off, so the tolerance checks the folded RoPE."""
    out, cos, sin, weight = make_inputs(70, 2, 128, 32, 2, 40, dtype, seed=1)
    with poisoned():
        y = op.grouped_wo_a(out, cos, sin, weight)
    ref = op.grouped_wo_a_ref(out, cos, sin, weight)
    unrotated = op.grouped_wo_a_ref(out, torch.ones_like(cos), torch.zeros_like(sin), weight)
    assert rel_err(y, ref) < TOL[dtype] and rel_err(unrotated, ref) > 0.1


@needs_triton
def test_row_block_of_wo_a(poisoned):
    """Tensor parallelism: a rank holding groups [2, 4) of 4 (their heads and wo_a rows) gets exactly
    those columns of the full op's output (bit for bit in fp32: same dots, same order)."""
    heads, head_dim, rd, rank = 8, 32, 8, 16
    out, cos, sin, weight = make_inputs(3, heads, head_dim, rd, 4, rank, torch.float32, seed=5)
    full = op.grouped_wo_a(out, cos, sin, weight)
    with poisoned():
        part = op.grouped_wo_a(out[:, heads // 2:].contiguous(), cos, sin, weight[2 * rank:])
    assert torch.equal(part, full[:, 2 * rank:])


@needs_triton
def test_no_rows():
    out, cos, sin, weight = make_inputs(0, 2, 32, 8, 2, 16, torch.float32, seed=0)
    assert op.grouped_wo_a(out, cos, sin, weight).shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_reference_is_the_previous_model_code_bit_for_bit(dtype, groups):
    heads, head_dim, rd, rank = 8, 32, 8, 24
    out, cos, sin, weight = make_inputs(17, heads, head_dim, rd, groups, rank, dtype, seed=groups, device="cpu")
    assert torch.equal(op.grouped_wo_a_ref(out, cos, sin, weight),
                       previous_project_out(out, cos, sin, weight, groups, rank))


def test_reference_validates_arguments():
    out, cos, sin, weight = make_inputs(3, 4, 32, 8, 2, 16, torch.float32, seed=0, device="cpu")
    ref = op.grouped_wo_a_ref
    with pytest.raises(ValueError, match="out must be"):
        ref(out.flatten(1), cos, sin, weight)
    with pytest.raises(ValueError, match="cos and sin"):
        ref(out, cos[:2], sin[:2], weight)
    with pytest.raises(ValueError, match="rotary dims"):
        ref(out, torch.ones(3, 17), torch.zeros(3, 17), weight)
    with pytest.raises(ValueError, match="weight must be"):
        ref(out, cos, sin, weight[:, :40])
    with pytest.raises(ValueError, match="weight rows 31"):
        ref(out, cos, sin, weight[:31])
    with pytest.raises(ValueError, match="dtype"):
        ref(out, cos, sin, weight.double())


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64, 256, 4096])
@pytest.mark.parametrize("layer", ["flash", "mini"])
def test_real_shapes_on_gpu(n, layer):
    """V4-Flash (H 64, G 8, R 1024: wo_a [8192, 4096]) and v4-mini (H 32, G 4, R 512), d 512, rd 64,
    bf16 (every tile class). Both the fused op and the reference must sit within the bf16 bound of
    a float64 computation on the same inputs, and within it of each other."""
    heads, groups, rank = (64, 8, 1024) if layer == "flash" else (32, 4, 512)
    out, cos, sin, weight = make_inputs(n, heads, 512, 64, groups, rank, torch.bfloat16, seed=n)
    y = op.grouped_wo_a(out, cos, sin, weight)
    ref = op.grouped_wo_a_ref(out, cos, sin, weight)
    exact = op.grouped_wo_a_ref(out.double(), cos.double(), sin.double(), weight.double())
    assert not y.isnan().any()
    assert rel_err(y, ref) < TOL[torch.bfloat16]
    assert rel_err(y, exact) < TOL[torch.bfloat16] and rel_err(ref, exact) < TOL[torch.bfloat16]


@needs_triton
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(4, 32, 8, 24), (4, 48, 16, 16), (8, 128, 16, 32)])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_decode_rows_run_as_a_gemv(n, shape, groups, poisoned):
    """The GEMV launch (`_wo_a_gemv_kernel`) at 1 to `linear.GEMV_MAX_ROWS` bf16 rows: rotary channels
    rotated per element, any head width against the K tile (d 32, 48, 128 with K tiles up to 1024 wide
    span several heads); the op takes it up to GEMV_ROWS rows."""
    heads, head_dim, rd, rank = shape
    out, cos, sin, weight = make_inputs(n, heads, head_dim, rd, groups, rank, torch.bfloat16, seed=n + groups)
    with poisoned():
        y = op.launch_wo_a_gemv(out, cos, sin, weight)
    ref = op.grouped_wo_a_ref(out, cos, sin, weight)
    unrotated = op.grouped_wo_a_ref(out, torch.ones_like(cos), torch.zeros_like(sin), weight)
    assert y.dtype == torch.bfloat16 and not y.isnan().any()
    assert rel_err(y, ref) < TOL[torch.bfloat16] and rel_err(unrotated, ref) > 0.05


@needs_triton
@pytest.mark.parametrize("n,dtype,max_elements,gemv", [(1, torch.bfloat16, 16384, True), (2, torch.bfloat16, 16384, False),
                                                       (1, torch.float32, 16384, False),
                                                       (1, torch.bfloat16, 16383, False)])
def test_the_op_takes_the_gemv_at_one_bf16_row(n, dtype, max_elements, gemv, monkeypatch):
    """GEMV_ROWS (1): the GEMV lost to the split kernel at 2 and 4 rows in the graph step; weights above
    GEMV_MAX_ELEMENTS (here lowered to the test weight's 16384, or one less) keep the split kernel."""
    out, cos, sin, weight = make_inputs(n, 8, 64, 16, 2, 32, dtype, seed=n)
    monkeypatch.setattr(op, "GEMV_MAX_ELEMENTS", max_elements)
    calls = []
    launch = op.launch_wo_a_gemv
    monkeypatch.setattr(op, "launch_wo_a_gemv", lambda *a: calls.append(a) or launch(*a))
    y = op.grouped_wo_a(out, cos, sin, weight)
    assert bool(calls) == gemv and rel_err(y, op.grouped_wo_a_ref(out, cos, sin, weight)) < TOL[dtype]


@needs_triton
def test_decode_gemv_takes_small_k_tiles_and_rejects_other_row_counts():
    out, cos, sin, weight = make_inputs(2, 8, 64, 16, 2, 32, torch.bfloat16, seed=4)
    y = op.launch_wo_a_gemv(out, cos, sin, weight, tiles=(4, 16, 4))  # 16-wide K tiles: one rotary pair block at a time
    assert rel_err(y, op.grouped_wo_a_ref(out, cos, sin, weight)) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="1 to 4 rows, got 5"):
        op.launch_wo_a_gemv(*make_inputs(5, 8, 64, 16, 2, 32, torch.bfloat16, seed=4))
