"""Compressor update (dspark/kernels/compressor.py): fused Triton vs the torch reference.

Groups as the models build them: V4 CSA (8 overlapping half-row slots; the first entry's "a"
slots empty, logit −inf), V4 HCA (128 slots, several slot tiles per program), V4.1 ratio 2
(fp32 rows, entries in the model dtype); bf16 and fp32.
"""

import pytest
import torch

from dspark.kernels import compressor, compressor_ref, triton_available
from dspark.kernels.rope_ref import rope_ref

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def make_inputs(n, slots, dim, kv_dtype, seed, empty_first=False):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, slots, dim, generator=g)
    score = torch.randn(n, slots, dim, generator=g) * 2
    if empty_first:  # entry 0 of an overlapping compressor: window −1 does not exist
        kv[0, : slots // 2] = 0
        score[0, : slots // 2] = float("-inf")
    weight = torch.rand(dim, generator=g) + 0.5
    return kv.to(DEVICE, kv_dtype), score.to(DEVICE), weight.to(DEVICE)


CASES = [  # (n, slots, d, kv dtype, out dtype, empty first slots)
    (3, 8, 32, torch.bfloat16, torch.bfloat16, True),  # V4 CSA / indexer compressor, bf16 model
    (2, 8, 48, torch.float32, torch.float32, True),  # fp32 model, d off the tiles
    (2, 128, 64, torch.bfloat16, torch.bfloat16, False),  # V4 HCA: 128 slots in two tiles
    (4, 2, 40, torch.float32, torch.bfloat16, False),  # V4.1 ratio 2: fp32 rows, bf16 entries
    (1, 2, 512, torch.float32, torch.float32, False),  # one decode entry at the real width
]


@needs_triton
@pytest.mark.parametrize("split", [False, True])  # one program per entry / channel blocks + norm launch
@pytest.mark.parametrize("n,slots,dim,kv_dtype,out_dtype,empty_first", CASES)
def test_compressor_pool_matches_ref(n, slots, dim, kv_dtype, out_dtype, empty_first, split, poisoned):
    kv, score, weight = make_inputs(n, slots, dim, kv_dtype, seed=slots + dim, empty_first=empty_first)
    with poisoned():
        out = compressor.launch_compressor_pool(kv, score, weight, eps=1e-6, out_dtype=out_dtype, split=split)
    ref = compressor.compressor_pool_ref(kv, score, weight, eps=1e-6, out_dtype=out_dtype)
    assert out.shape == (n, dim) and out.dtype == out_dtype and not out.isnan().any()
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOL[out_dtype]


@needs_triton
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("n,slots,dim,kv_dtype,out_dtype,empty_first", CASES)
def test_gathered_slots_match_the_copied_ones(n, slots, dim, kv_dtype, out_dtype, empty_first, split, poisoned):
    """`compressor_pool_gather` reads each slot through an index into [R, d] rows (−1: empty): the rows
    shuffled and padded, the same entries as `compressor_pool` of the gathered copies."""
    kv, score, weight = make_inputs(n, slots, dim, kv_dtype, seed=slots + dim + 1, empty_first=empty_first)
    g = torch.Generator().manual_seed(n)
    order = torch.randperm(n * slots + 5, generator=g)[: n * slots]  # where slot (e, j) lives among the rows
    kv_rows = torch.randn(n * slots + 5, dim, generator=g).to(DEVICE, kv_dtype)
    score_rows = torch.randn(n * slots + 5, dim, generator=g).to(DEVICE)
    kv_rows[order.to(DEVICE)] = kv.reshape(-1, dim)
    score_rows[order.to(DEVICE)] = score.reshape(-1, dim)
    index = order.view(n, slots).to(DEVICE)
    if empty_first:  # the empty slots as −1 instead of −inf rows
        index[0, : slots // 2] = -1
    ref = compressor.compressor_pool_gather_ref(kv_rows, score_rows, index, weight, eps=1e-6, out_dtype=out_dtype)
    expected = compressor.compressor_pool_ref(kv, score, weight, eps=1e-6, out_dtype=out_dtype)
    assert torch.equal(ref, expected)
    with poisoned():
        out = compressor._launch(kv_rows, score_rows, index, weight, n, slots, 1e-6, out_dtype, split=split)
    assert out.dtype == out_dtype and not out.isnan().any()
    assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() < TOL[out_dtype]
    if split == (n < compressor.SPLIT_BELOW):  # the op's own choice of launch
        op = compressor.compressor_pool_gather(kv_rows, score_rows, index, weight, eps=1e-6, out_dtype=out_dtype)
        assert torch.equal(out, op)


def test_gather_reference_validates_arguments():
    rows = torch.randn(6, 8)
    with pytest.raises(ValueError, match="index must be an integer"):
        compressor_ref.compressor_pool_gather_ref(rows, rows, torch.zeros(2, 3), torch.ones(8), eps=1e-6,
                                                  out_dtype=torch.float32)
    with pytest.raises(ValueError, match="one shape"):
        compressor_ref.compressor_pool_gather_ref(rows, rows[:5], torch.zeros(2, 3, dtype=torch.long),
                                                  torch.ones(8), eps=1e-6, out_dtype=torch.float32)


@needs_triton
def test_compressor_pool_without_entries():
    kv, score, weight = make_inputs(0, 2, 16, torch.float32, seed=0)
    assert compressor.compressor_pool(kv, score, weight, eps=1e-6, out_dtype=torch.float32).shape == (0, 16)


def test_reference_is_pooling_then_norm():
    """One channel by hand: slots with logits 0 and ln 3 weigh 1/4 and 3/4; the norm rescales."""
    kv = torch.tensor([[[4.0, 1.0], [8.0, 1.0]]])  # [1 entry, 2 slots, 2 channels]
    score = torch.tensor([[[0.0, 0.0], [torch.log(torch.tensor(3.0)), 0.0]]])
    out = compressor_ref.compressor_pool_ref(kv, score, torch.ones(2), eps=0.0, out_dtype=torch.float32)
    pooled = torch.tensor([7.0, 1.0])  # 4/4 + 8·3/4, and 1
    torch.testing.assert_close(out[0], pooled / pooled.square().mean().sqrt())


def test_reference_validates_arguments():
    kv, score, weight = make_inputs(2, 4, 8, torch.float32, seed=0)
    op = compressor_ref.compressor_pool_ref
    with pytest.raises(ValueError, match="score"):
        op(kv, score[:, :2], weight, eps=1e-6, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="norm_weight"):
        op(kv, score, weight[:4], eps=1e-6, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        op(kv, score, weight, eps=1e-6, out_dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("n,slots,dim", [(1, 8, 512), (1, 8, 128), (1, 128, 512), (256, 8, 512), (64, 128, 512)])
def test_real_shapes_on_gpu(n, slots, dim, split):
    """V4-Flash widths: CSA (8 slots × 512), its indexer (8 × 128), HCA (128 × 512), bf16."""
    kv, score, weight = make_inputs(n, slots, dim, torch.bfloat16, seed=n, empty_first=slots == 8)
    out = compressor.launch_compressor_pool(kv, score, weight, eps=1e-6, out_dtype=torch.bfloat16, split=split)
    ref = compressor.compressor_pool_ref(kv, score, weight, eps=1e-6, out_dtype=torch.bfloat16)
    assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() < TOL[torch.bfloat16]


def _destination(n, dim, half, out_dtype, seed):
    """A poisoned destination of n + 5 rows (NaN: a row written by mistake shows), n distinct rows of
    it for the entries, and random RoPE tables [n, half]."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((n + 5, dim), float("nan"), dtype=out_dtype, device=DEVICE)
    rows = torch.randperm(n + 5, generator=g)[:n].to(DEVICE)
    angles = torch.rand(n, half, generator=g).to(DEVICE) * 6
    return out, rows, (angles.cos(), angles.sin())


DEST_CASES = [  # (n, slots, d, rd/2, kv dtype, out dtype): CSA and its indexer (rd 16 of 32 / 48), HCA
    (3, 8, 32, 8, torch.bfloat16, torch.bfloat16),
    (2, 8, 48, 16, torch.float32, torch.float32),
    (2, 128, 64, 8, torch.bfloat16, torch.bfloat16),
]


@needs_triton
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("n,slots,dim,half,kv_dtype,out_dtype", DEST_CASES)
def test_gather_with_rope_and_destination_matches_ref(n, slots, dim, half, kv_dtype, out_dtype, split, poisoned):
    """The entries rotated and stored at their rows by the pooling launches equal the reference's
    pool, `rope_ref`, `index_copy_`; every row not named keeps its (NaN) poison."""
    kv, score, weight = make_inputs(n, slots, dim, kv_dtype, seed=dim + half)
    kv_rows, score_rows = kv.reshape(-1, dim), score.reshape(-1, dim)
    index = torch.arange(n * slots, device=DEVICE).view(n, slots)
    index[0, : slots // 2] = -1
    out, rows, cos_sin = _destination(n, dim, half, out_dtype, seed=n)
    ref = compressor.compressor_pool_gather_ref(kv_rows, score_rows, index, weight, eps=1e-6, out_dtype=out_dtype,
                                                cos_sin=cos_sin, out=out.clone(), out_rows=rows)
    plain = compressor.compressor_pool_gather_ref(kv_rows, score_rows, index, weight, eps=1e-6, out_dtype=out_dtype)
    assert torch.equal(ref[rows], rope_ref(plain, *cos_sin))
    with poisoned():
        got = compressor._launch(kv_rows, score_rows, index, weight, n, slots, 1e-6, out_dtype, split,
                                 cos_sin=cos_sin, out=out, out_rows=rows)
    assert got is out
    untouched = torch.ones(n + 5, dtype=torch.bool, device=DEVICE)
    untouched[rows] = False
    assert out[untouched].isnan().all() and not out[rows].isnan().any()
    assert rel_err(out[rows], ref[rows]) < TOL[out_dtype]


@needs_triton
def test_gather_op_stores_in_place_without_rope(poisoned):
    """Destination only (no tables): the op's own launch choice, the reference's rows bit for bit in fp32."""
    n, slots, dim = 2, 8, 32
    kv, score, weight = make_inputs(n, slots, dim, torch.float32, seed=9)
    index = torch.arange(n * slots, device=DEVICE).view(n, slots)
    out, rows, _ = _destination(n, dim, 4, torch.float32, seed=2)
    args = (kv.reshape(-1, dim), score.reshape(-1, dim), index, weight)
    ref = compressor.compressor_pool_gather_ref(*args, eps=1e-6, out_dtype=torch.float32)
    got = compressor.compressor_pool_gather(*args, eps=1e-6, out_dtype=torch.float32, out=out, out_rows=rows)
    assert got is out and rel_err(out[rows], ref) < TOL[torch.float32]
    assert out.isnan().sum() == 5 * dim


def test_gather_destination_is_validated():
    rows = torch.randn(16, 8)
    index = torch.zeros(2, 4, dtype=torch.long)
    op = compressor_ref.compressor_pool_gather_ref
    kw = dict(eps=1e-6, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="go together"):
        op(rows, rows, index, torch.ones(8), out=torch.zeros(4, 8), **kw)
    with pytest.raises(ValueError, match="out must be"):
        op(rows, rows, index, torch.ones(8), out=torch.zeros(4, 8).bfloat16(), out_rows=torch.tensor([0, 1]), **kw)
    with pytest.raises(ValueError, match="out_rows must be"):
        op(rows, rows, index, torch.ones(8), out=torch.zeros(4, 8), out_rows=torch.tensor([0, 1, 2]), **kw)
    with pytest.raises(ValueError, match="cos_sin"):
        op(rows, rows, index, torch.ones(8), cos_sin=(torch.ones(2, 5), torch.ones(2, 5)), **kw)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("slots,dim", [(8, 512), (8, 128), (128, 512)])
def test_gather_rope_destination_real_shapes_on_gpu(slots, dim, split):
    """v4-mini's static step at batch 1: one entry (CSA / indexer / HCA, rd 64) stored in a big entry buffer."""
    n = 1
    kv, score, weight = make_inputs(n, slots, dim, torch.bfloat16, seed=dim, empty_first=slots == 8)
    index = torch.arange(n * slots, device=DEVICE).view(n, slots)
    out, rows, cos_sin = _destination(n, dim, 32, torch.bfloat16, seed=slots)
    args = (kv.reshape(-1, dim), score.reshape(-1, dim), index, weight)
    ref = compressor.compressor_pool_gather_ref(*args, eps=1e-6, out_dtype=torch.bfloat16, cos_sin=cos_sin,
                                                out=out.clone(), out_rows=rows)
    compressor._launch(*args, n, slots, 1e-6, torch.bfloat16, split, cos_sin=cos_sin, out=out, out_rows=rows)
    assert rel_err(out[rows], ref[rows]) < TOL[torch.bfloat16]
    assert out.isnan().sum() == 5 * dim
