"""V4.1 cache QAT rounding as one kernel (dspark/kernels/cache_round.py) against the torch formats of
`dspark.models.deepseek_v41.qat`: bit-identical on random blocks of every magnitude (the clamps, the
e4m3 subnormal step, saturation), on values placed exactly on rounding ties, in fp32 and bf16; the
model's `CacheQuant` on the fused op gives the reference logits; arguments are checked."""

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig, triton_available
from dspark.kernels import cache_round as op

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FMTS = sorted(op.FORMATS)


def random_blocks(n_rows, width, seed):
    """Rows whose blocks span magnitudes 2^-30 .. 2^12 (some blocks all below each format's amax floor)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, width, generator=g)
    exponents = torch.randint(-30, 13, (n_rows, width // 16), generator=g).float()
    return x * torch.exp2(exponents).repeat_interleave(16, dim=1)


def ties(fmt):
    """Blocks whose scaled values sit exactly halfway between grid points (and on them): amax pinned
    so the scale is 1 (UE8M0) or a known e4m3 value, the rest midpoints of the grid."""
    if fmt == "fp8_ue8m0":  # scale 2^0 needs amax in (224, 448]: 448 first, then e4m3 midpoints
        grid = torch.tensor([2.0 ** e * (1 + m / 8) for e in range(-6, 8) for m in range(8)] + [2.0 ** -9 * k for k in range(8)])
        mids = (grid[:-1] + grid[1:]) / 2
        vals = torch.cat([mids, -mids, grid])
        block = 32
        head = 448.0
    else:
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        mids = (grid[:-1] + grid[1:]) / 2
        vals = torch.cat([mids, -mids, grid, grid * 1.25])
        block = op.FORMATS[fmt][0]
        head = 6.0  # amax 6: scale 1 (UE8M0: 2^ceil(log2 1) = 1; e4m3: e4m3(1) = 1)
    n = -(-len(vals) // (block - 1))
    vals = torch.cat([vals, torch.zeros(n * (block - 1) - len(vals))]).reshape(n, block - 1)
    return torch.cat([torch.full((n, 1), head), vals], dim=1).reshape(-1, block * 2 if block == 16 else block)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FMTS)
def test_random_blocks_round_like_the_reference(fmt, dtype, poisoned):
    x = random_blocks(37, 64, seed=len(fmt)).to(DEVICE, dtype)
    with poisoned():
        y = op.cache_round(x, fmt=fmt)
    ref = op.cache_round_ref(x, fmt=fmt)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, ref), (y - ref).abs().max()
    assert not torch.equal(ref, x)  # the formats do round


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
def test_ties_round_to_even_like_the_reference(fmt):
    x = ties(fmt).to(DEVICE)
    assert torch.equal(op.cache_round(x, fmt=fmt), op.cache_round_ref(x, fmt=fmt))


@needs_triton
def test_leading_dims_and_empty_inputs():
    x = random_blocks(6, 32, seed=3).reshape(2, 3, 32).to(DEVICE)
    assert torch.equal(op.cache_round(x, fmt="fp4_ue8m0"), op.cache_round_ref(x, fmt="fp4_ue8m0"))
    empty = torch.empty(0, 32, device=DEVICE)
    assert op.cache_round(empty, fmt="fp8_ue8m0").shape == (0, 32)


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
def test_rows_written_into_out_like_the_reference(fmt, poisoned):
    """With out / out_rows each rounded row goes to its row of out (the static step's window ring,
    bf16 from fp32 rows here); the other rows of out stay as they were."""
    x = random_blocks(5, 64, seed=7).reshape(5, 64).to(DEVICE)
    rows = torch.tensor([6, 0, 3, 9, 1], device=DEVICE)
    before = torch.randn(11, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    ref = op.cache_round_ref(x, fmt=fmt, out=before.clone(), out_rows=rows)
    assert torch.equal(op.cache_round_ref(x, fmt=fmt, out=before.clone(), out_rows=rows.int()), ref)
    with poisoned():
        out = before.clone()
        y = op.cache_round(x, fmt=fmt, out=out, out_rows=rows.int())
    assert y is out and torch.equal(out, ref)
    assert torch.equal(out[rows], op.cache_round_ref(x, fmt=fmt).bfloat16())
    untouched = torch.ones(11, dtype=torch.bool, device=DEVICE).index_fill_(0, rows, False)
    assert torch.equal(out[untouched], before[untouched])


def test_bad_arguments_name_the_value():
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="fmt must be one of"):
        op.cache_round_ref(x, fmt="fp8")
    with pytest.raises(ValueError, match="multiple of 16 for fp4_e4m3"):
        op.cache_round_ref(x[:, :8], fmt="fp4_e4m3")
    with pytest.raises(ValueError, match="a float"):
        op.cache_round_ref(x.long(), fmt="fp8_ue8m0")
    with pytest.raises(ValueError, match="out and out_rows go together"):
        op.cache_round_ref(x, fmt="fp8_ue8m0", out=torch.empty(4, 32))
    with pytest.raises(ValueError, match=r"out_rows must be \[2\] int32 / int64"):
        op.cache_round_ref(x, fmt="fp8_ue8m0", out=torch.empty(4, 32), out_rows=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"out must be a contiguous \[R, 32\]"):
        op.cache_round_ref(x, fmt="fp8_ue8m0", out=torch.empty(4, 16), out_rows=torch.zeros(2, dtype=torch.long))


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
def test_every_program_size_rounds_alike(fmt):
    """The launch's blocks per program (`launch_cache_round(rows=)`, swept by the bench) changes
    only how the blocks are split: ragged last programs, rows written into out alike."""
    x = random_blocks(5, 96, seed=3).to(DEVICE)
    ref = op.cache_round_ref(x, fmt=fmt)
    rows = torch.tensor([4, 0, 6, 2, 1], device=DEVICE)
    for per_program in (1, 2, 8, 64):
        assert torch.equal(op.launch_cache_round(x, fmt, None, None, per_program), ref), per_program
        out = torch.zeros(7, 96, device=DEVICE)
        op.launch_cache_round(x, fmt, out, rows, per_program)
        assert torch.equal(out[rows], ref), per_program
    with pytest.raises(ValueError, match="rows must be a power of two, got 3"):
        op.launch_cache_round(x, fmt, None, None, 3)


@needs_triton
@torch.no_grad()
def test_v41_model_with_the_fused_rounding_gives_the_reference_logits():
    """tiny-v41 with cache QAT: the fused op in every CacheQuant call; rounding is exact, so the
    logits of a prefill and four decode steps are those of the reference model."""
    base = KernelConfig()
    models = [dspark.init_model("tiny-v41", seed=0, device=DEVICE, dtype=torch.float32, cache_qat=True,
                                kernels=k) for k in (base, KernelConfig(cache_round="triton"))]
    assert models[1].layers[0].attn.quant.round_op is op.cache_round
    outs = []
    for model in models:
        state = model.new_state()
        ids = torch.tensor([5, 9, 2, 7], device=DEVICE)
        logits = [model(ids, [state], [len(ids)]).logits]
        for t in (3, 11, 1, 8):
            logits.append(model(torch.tensor([t], device=DEVICE), [state], [1]).logits)
        outs.append(torch.cat(logits))
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_real_sizes_on_gpu(fmt):
    """A v41-mini step's shapes: 64 rows of the 512-wide window latents / entries, 64 × 32 heads of
    128-wide index vectors; random blocks and ties, bit for bit."""
    width = 128 if fmt == "fp4_ue8m0" else 512
    x = random_blocks(64 * (32 if width == 128 else 1), width, seed=width).cuda()
    assert torch.equal(op.cache_round(x, fmt=fmt), op.cache_round_ref(x, fmt=fmt))
    assert torch.equal(op.cache_round(x.bfloat16(), fmt=fmt), op.cache_round_ref(x.bfloat16(), fmt=fmt))
    t = ties(fmt).cuda()
    assert torch.equal(op.cache_round(t, fmt=fmt), op.cache_round_ref(t, fmt=fmt))


@needs_triton
def test_e4m3_scale_saturates_past_448():
    """Blocks whose amax / 6 is past e4m3's 448: the scale saturates at 448 in the reference on every
    device (torch's CUDA float8 cast gives NaN there, its CPU cast saturates) and in the kernel."""
    x = random_blocks(4, 64, seed=3).to(DEVICE) + torch.tensor([[5e4] + [0.0] * 63] * 4, device=DEVICE)
    ref = op.cache_round_ref(x, fmt="fp4_e4m3")
    assert torch.isfinite(ref).all() and ref[:, 0].eq(6 * 448.0).all()
    assert torch.equal(op.cache_round(x, fmt="fp4_e4m3"), ref)
