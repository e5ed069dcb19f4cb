import math

import pytest
import torch

from dspark.quant import (
    E2M1_VALUES,
    ENGRAM_BLOCK,
    FP4_BLOCK,
    V4_DENSE_BLOCK,
    V41_DENSE_BLOCK,
    block_grid,
    decode_e2m1,
    round_e2m1,
    dequantize_fp4,
    dequantize_fp8,
    encode_e2m1,
    pack_fp4,
    quantize_fp4,
    quantize_fp8,
    scale_to_float,
    ue8m0_from_exponent,
    unpack_fp4,
)


def random_weight(shape, seed=0):
    """Random values whose magnitude varies a lot between rows and columns, so that blocks get
    different scales, with no exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    magnitude = torch.exp2(torch.randint(-12, 6, shape[-2:], generator=g).float())
    return torch.where(x == 0, 0.125, x) * magnitude


def reference_scales(x, block, max_element):
    """2**ceil(log2(amax / max_element)) per block, by explicit Python loops over the grid."""
    *_, mb, kb = block_grid(x.shape, block)
    out = torch.empty(mb, kb)
    for i in range(mb):
        for j in range(kb):
            tile = x[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            out[i, j] = 2.0 ** math.ceil(math.log2(tile.abs().max().item() / max_element))
    return out


# --- spec vectors (deepseek_v4 §18.2, §13.3) --------------------------------------------------


def test_fp4_byte_0x2f_decodes_to_minus6_then_plus1():
    packed = torch.tensor([[0x2F]], dtype=torch.uint8).view(torch.int8)
    assert decode_e2m1(unpack_fp4(packed)).tolist() == [[-6.0, 1.0]]
    one_scale = ue8m0_from_exponent(torch.zeros(1, 1, dtype=torch.int32))
    assert dequantize_fp4(packed, one_scale, block=(1, 32)).tolist() == [[-6.0, 1.0]]


def test_ue8m0_bytes_127_and_130():
    raw = torch.tensor([127, 130, 126], dtype=torch.uint8)
    assert scale_to_float(raw).tolist() == [1.0, 8.0, 0.5]
    if hasattr(torch, "float8_e8m0fnu"):
        assert scale_to_float(raw.view(torch.float8_e8m0fnu)).tolist() == [1.0, 8.0, 0.5]
    encoded = ue8m0_from_exponent(torch.tensor([0, 3, -1]))
    assert encoded.view(torch.uint8).tolist() == [127, 130, 126]


def test_e2m1_table_round_trips_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    assert values.dtype == torch.float32 and values.tolist() == list(E2M1_VALUES)
    assert values.signbit().tolist() == [v < 0 or str(v) == "-0.0" for v in E2M1_VALUES]  # -0.0 kept
    assert decode_e2m1(codes.view(4, 4)).shape == (4, 4)
    # -0.0 encodes to +0's code: both decode to zero.
    assert decode_e2m1(encode_e2m1(values)).tolist() == list(E2M1_VALUES)


def test_e2m1_rounds_to_nearest_with_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 2.6, 5.1, 7.0, -0.8, -4.9])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 3.0, 6.0, 6.0, -1.0, -4.0]
    assert decode_e2m1(encode_e2m1(x)).tolist() == expected


def test_e2m1_encoding_matches_brute_force_nearest():
    x = torch.cat([torch.linspace(0, 7, 7001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])])
    grid = torch.tensor(E2M1_VALUES[:8])
    distance = (x[:, None] - grid[None]).abs()
    nearest = distance == distance.min(dim=1, keepdim=True).values  # [n, 8], two entries on a tie
    even_code = (torch.arange(8) % 2 == 0).int()
    expected = torch.where(nearest.sum(1) > 1, (nearest.int() * even_code).argmax(1), distance.argmin(1))
    assert torch.equal(encode_e2m1(x).long(), expected)
    assert torch.equal(decode_e2m1(encode_e2m1(-x)), -grid[expected])


def test_pack_puts_even_element_in_low_nibble():
    codes = torch.tensor([[0xF, 0x2, 0x1, 0x8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x2F, 0x81]]
    assert torch.equal(unpack_fp4(packed), codes)


# --- FP8 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, block",
    [
        ((256, 384), V4_DENSE_BLOCK),
        ((200, 300), V4_DENSE_BLOCK),  # ragged on both axes
        ((96, 70), V41_DENSE_BLOCK),  # MXFP8, ragged K
        ((7, 100), ENGRAM_BLOCK),  # Engram per-32, ragged K
    ],
)
def test_fp8_scales_and_error_bound(shape, block):
    x = random_weight(shape)
    q, scale = quantize_fp8(x, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert tuple(scale.shape) == block_grid(shape, block)
    assert torch.equal(scale_to_float(scale), reference_scales(x, block, 448.0))
    y = dequantize_fp8(q, scale, block)
    # e4m3 keeps 3 mantissa bits (relative half-step 2**-4); subnormals are spaced scale * 2**-9.
    step = scale_to_float(scale).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    step = step[: shape[0], : shape[1]]
    assert ((y - x).abs() <= x.abs() * 2**-4 + step * 2**-10).all()
    assert (y != x).any(), "random inputs should not all be representable"


def test_fp8_requantising_representable_tensor_is_exact():
    x = dequantize_fp8(*quantize_fp8(random_weight((200, 300), seed=1)))
    assert torch.equal(dequantize_fp8(*quantize_fp8(x)), x)
    xb = x.to(torch.bfloat16)
    assert torch.equal(dequantize_fp8(*quantize_fp8(xb), dtype=torch.bfloat16), xb)


def test_fp8_leading_dims_quantise_each_matrix_separately():
    x = random_weight((3, 40, 50), seed=2)
    q, scale = quantize_fp8(x, (32, 32))
    assert tuple(scale.shape) == (3, 2, 2)
    for i in range(3):
        qi, si = quantize_fp8(x[i], (32, 32))
        assert torch.equal(q[i].view(torch.uint8), qi.view(torch.uint8))
        assert torch.equal(scale_to_float(scale[i]), scale_to_float(si))


def test_fp8_zero_block_stays_zero_and_finite():
    x = random_weight((256, 256), seed=3)
    x[:128, :128] = 0
    y = dequantize_fp8(*quantize_fp8(x))
    assert torch.isfinite(y).all() and (y[:128, :128] == 0).all()


def test_fp8_accepts_raw_byte_and_float_scales():
    q, scale = quantize_fp8(random_weight((130, 260), seed=4))
    expected = dequantize_fp8(q, scale)
    assert torch.equal(dequantize_fp8(q, scale.view(torch.uint8)), expected)
    assert torch.equal(dequantize_fp8(q, scale_to_float(scale)), expected)


def test_fp8_dequantize_rejects_wrong_scale_grid():
    q, scale = quantize_fp8(random_weight((200, 300)))
    with pytest.raises(ValueError, match=r"expected \(2, 3\)"):
        dequantize_fp8(q, scale[:, :2], V4_DENSE_BLOCK)


# --- FP4 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 128), (33, 70), (2, 5, 96)])
def test_fp4_scales_and_error_bound(shape):
    x = random_weight(shape, seed=5)
    packed, scale = quantize_fp4(x)
    assert packed.dtype == torch.int8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert tuple(scale.shape) == block_grid(shape, FP4_BLOCK)
    if len(shape) == 2:
        assert torch.equal(scale_to_float(scale), reference_scales(x, FP4_BLOCK, 6.0))
    y = dequantize_fp4(packed, scale)
    assert y.shape == x.shape
    # Grid spacing is 0.5 below 2, 1 in [2, 4], 2 in [4, 6]: half a step is <= max(s/4, |x|/4).
    step = scale_to_float(scale).repeat_interleave(32, -1)[..., : shape[-1]]
    assert ((y - x).abs() <= torch.maximum(step / 4, x.abs() / 4)).all()


def test_fp4_requantising_representable_tensor_is_exact():
    x = dequantize_fp4(*quantize_fp4(random_weight((48, 96), seed=6)))
    assert torch.equal(dequantize_fp4(*quantize_fp4(x)), x)


def test_fp4_packed_dtypes_agree():
    packed, scale = quantize_fp4(random_weight((16, 64), seed=7))
    expected = dequantize_fp4(packed, scale)
    assert torch.equal(dequantize_fp4(packed.view(torch.uint8), scale), expected)
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert torch.equal(dequantize_fp4(packed.view(torch.float4_e2m1fn_x2), scale), expected)


def test_fp4_rejects_odd_k():
    with pytest.raises(ValueError, match="even"):
        quantize_fp4(random_weight((4, 33)))


def test_round_e2m1_is_encode_then_decode_bit_for_bit():
    """`round_e2m1` (what the V4.1 cache QAT uses) gives exactly decode(encode(x)): every tie, the
    piece boundaries, saturation, signed zeros, infinities; fp32, bf16 and fp16 inputs."""
    g = torch.Generator().manual_seed(0)
    grid = torch.arange(-700, 701) / 100.0
    x = torch.cat([torch.randn(50000, generator=g) * 3, torch.randn(20000, generator=g) * 20, grid,
                   grid * (1 + 2**-23), torch.tensor([0.0, -0.0, 0.25, -0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0,
                                                      6.0, 7.0, -7.0, 1e-30, -1e-30, float("inf"), -float("inf")])])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ours, codes = round_e2m1(x.to(dtype)), decode_e2m1(encode_e2m1(x.to(dtype)))
        assert ours.dtype == torch.float32 and torch.equal(ours, codes)
        assert torch.equal(ours.signbit(), codes.signbit())
