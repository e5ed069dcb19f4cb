"""Decode MoE through TMA (dspark/kernels/moe_decode_tma.py) against `moe.moe_experts_ref`.

On CPU the kernels run in the Triton interpreter (tests/kernels/conftest.py): D = 96, I = 80 (routed),
48 (shared) are off every tile and step, so the descriptors' out-of-bounds tiles (zero-filled) and the
stores' masks are reached; FP8 with 32×32 blocks at steps inside one block and over several.
"""

import pytest
import torch

from dspark.kernels import moe, moe_decode, moe_decode_tma, triton_available
from test_moe import TOL, _off_tile_experts, rel_err  # noqa: E402 (tests/kernels is on sys.path: prepend mode)

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")


@pytest.mark.parametrize("tiles", [(16, 16, 4, 16, 16, 4, 2), (16, 64, 4, 32, 32, 4, 3), (32, 32, 4, 16, 128, 4, 4)])
@pytest.mark.parametrize("fp8_block", [None, 32])
@pytest.mark.parametrize("n_tok", [1, 2])
def test_tma_experts_match_the_reference(tiles, fp8_block, n_tok, poisoned):
    args = _off_tile_experts(n_tok, fp8_block, seed=21)
    with poisoned():
        y = moe_decode_tma.tma_experts(*args, 10.0, moe_decode_tma.TmaTiles(*tiles))
    assert rel_err(y, moe.moe_experts_ref(*args, swiglu_limit=10.0)) < TOL[torch.float32]


@pytest.mark.parametrize("fp8_block", [None, 32])
def test_tma_up_rows_are_the_gemv_kernels_rows(fp8_block, poisoned):
    """h (routed rows, then the shared rows) as `moe_decode.decode_up` lays it out, so either down kernel
    can read either up kernel's output."""
    x, weights, ids, w1, w2, w3, s1, s2, s3 = _off_tile_experts(2, fp8_block, seed=3)
    with poisoned():
        h, sizes = moe_decode_tma.tma_up(x, ids, w1, w3, s1, s3, 10.0)
    h_ref, args = moe_decode.decode_up(x, ids, w1, w3, s1, s3, 10.0)
    assert h.shape == h_ref.shape and sizes == args[:-1]
    assert rel_err(h[:6], h_ref[:6]) < TOL[torch.float32]  # 2 tokens × top-3 routed rows, I = 80
    assert rel_err(h[6:, :48], h_ref[6:, :48]) < TOL[torch.float32]  # the shared rows, I_s = 48
    y = moe_decode_tma.tma_down(h_ref, x, weights, ids, w2, s2, sizes)
    assert rel_err(y, moe_decode.decode_down(h_ref, x, weights, ids, w2, s2, args)) < TOL[torch.float32]


def test_tma_tiles_are_checked():
    args = _off_tile_experts(1, 32, seed=0)
    with pytest.raises(ValueError, match="rows 64 must divide the FP8 block 32"):
        moe_decode_tma.tma_experts(*args, 10.0, moe_decode_tma.TmaTiles(up_n=64))
    with pytest.raises(ValueError, match="powers of two .* got 16, 48"):
        moe_decode_tma.tma_experts(*args, 10.0, moe_decode_tma.TmaTiles(down_k=48))
