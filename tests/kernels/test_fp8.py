"""FP8BlockWeight (dspark/kernels/fp8.py): UE8M0 block scales as in deepseek_v4 spec §13.3."""

import pytest
import torch

from dspark.kernels.fp8 import FP8BlockWeight


def test_ue8m0_scale_is_a_power_of_two_multiplier():
    """Spec §18.2: byte 127 -> 1.0; §13.3: byte 130 -> 8.0, and the scale multiplies."""
    data = torch.tensor([[1.5, -2.0], [0.25, 3.0]]).to(torch.float8_e4m3fn)
    for byte, factor in ((127, 1.0), (130, 8.0), (125, 0.25)):
        w = FP8BlockWeight(data, torch.full((1, 1), byte, dtype=torch.uint8), block=16)
        torch.testing.assert_close(w.dequantize(), data.float() * factor, atol=0, rtol=0)


def test_dequantize_uses_each_blocks_own_scale():
    data = torch.full((4, 40), 1.0).to(torch.float8_e4m3fn)  # [4, 40] with block 16: 1 × 3 blocks
    scale = torch.tensor([[127, 128, 129]], dtype=torch.uint8)
    dense = FP8BlockWeight(data, scale, block=16).dequantize()
    assert dense[:, :16].eq(1.0).all() and dense[:, 16:32].eq(2.0).all() and dense[:, 32:].eq(4.0).all()


@pytest.mark.parametrize("block", [32, 128])
def test_quantize_round_trip_within_e4m3_precision(block):
    g = torch.Generator().manual_seed(block)
    w = torch.randn(3, 200, 136, generator=g) * torch.exp2(torch.randint(-6, 6, (3, 1, 1), generator=g).float())
    q = FP8BlockWeight.quantize(w, block)
    assert q.data.shape == w.shape and q.scale.shape == (3, -(-200 // block), -(-136 // block))
    err = (q.dequantize() - w).abs()
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, and the block's
    # power-of-two scale keeps |w|/scale <= 448, so small values lose at most the subnormal step.
    bound = w.abs() * 2.0**-4 + 2.0**-9 * torch.exp2(q.scale.float() - 127).amax()
    assert (err <= bound).all()
    assert torch.equal(q.dequantize(index=1), q.dequantize()[1])


def test_accepts_e8m0_scale_dtype():
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is None:
        pytest.skip("this torch has no float8_e8m0fnu dtype")
    data = torch.ones(2, 2).to(torch.float8_e4m3fn)
    w = FP8BlockWeight(data, torch.full((1, 1), 129, dtype=torch.uint8).view(e8m0), block=16)
    assert w.scale.dtype == torch.uint8 and w.dequantize().eq(4.0).all()


@pytest.mark.parametrize("bad", ["data", "scale_shape", "scale_dtype", "block"])
def test_rejects_bad_arguments(bad):
    data = torch.ones(4, 4).to(torch.float8_e4m3fn)
    scale = torch.full((1, 1), 127, dtype=torch.uint8)
    block = 16
    if bad == "data":
        data = data.float()
    elif bad == "scale_shape":
        scale = torch.full((2, 1), 127, dtype=torch.uint8)
    elif bad == "scale_dtype":
        scale = scale.to(torch.int8)
    else:
        block = 24
    with pytest.raises(ValueError, match="block" if bad == "block" else bad.split("_")[0]):
        FP8BlockWeight(data, scale, block)
