"""Block-scaled FP8 and FP4 codecs used by DeepSeek checkpoints, in both directions.

Every layout pairs low-precision elements with one power-of-two scale per block, stored as a
UE8M0 byte ``b`` meaning ``2 ** (b - 127)`` (byte 127 is 1.0, byte 130 is 8.0, byte 255 is NaN):

=============================  =======================  ===========  =====================
tensor                         element                  block        spec
=============================  =======================  ===========  =====================
V4 dense linears               FP8 e4m3                 128 x 128    deepseek_v4 §13.2
V4.1 dense linears (MXFP8)     FP8 e4m3                 32 x 32      deepseek_v41 §11.2
routed experts (V4 and V4.1)   FP4 e2m1, 2 per byte     1 x 32 (K)   deepseek_v4 §13.3
V4.1 Engram tables             FP8 e4m3                 1 x 32       deepseek_v41 §8.4
=============================  =======================  ===========  =====================

Dequantisation multiplies (``W = element * scale``). Quantisation picks the smallest power of
two that brings the block's largest magnitude within the element range,
``scale = 2 ** ceil(log2(amax / max_element))``, then rounds each element to the nearest
representable value (ties to even). Because scales are powers of two, quantising a tensor that
is already representable returns it bit for bit.

A weight's block grid covers the last two dimensions; dimensions that the block does not divide
get smaller (ragged) edge blocks, so the grid is ``[ceil(M / bm), ceil(K / bk)]``. Leading
dimensions (stacked experts) are carried through.

Shape symbols: ``M`` rows (output features), ``K`` columns (input features), ``bm x bk`` the
block, ``Mb = ceil(M / bm)``, ``Kb = ceil(K / bk)``, ``...`` optional leading dimensions.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0

V4_DENSE_BLOCK = (128, 128)
V41_DENSE_BLOCK = (32, 32)
FP4_BLOCK = (1, 32)
ENGRAM_BLOCK = (1, 32)
# Activations quantised at inference (FP8 GEMM inputs) take their block max as at least this.
ACTIVATION_AMAX_FLOOR = 1e-4

# e2m1 code -> value; bit 3 is the sign, so codes 8..15 mirror 0..7 (spec §13.3 table).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_UE8M0_BIAS = 127
# UE8M0 bytes 0..254 are the exponents -127..127; byte 255 is NaN and never produced.
_MIN_EXPONENT, _MAX_EXPONENT = -127, 127

# torch gained float8_e8m0fnu after 2.4 (the oldest torch we support); without it scales travel
# as raw uint8 exponent bytes, which every function here accepts too.
UE8M0_DTYPE = getattr(torch, "float8_e8m0fnu", torch.uint8)
FP8_DTYPE = torch.float8_e4m3fn  # present in every torch >= 2.1
PACKED_FP4_DTYPES = tuple(
    dtype for dtype in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if dtype is not None
)


# ---------------------------------------------------------------------------------------------
# UE8M0 scales
# ---------------------------------------------------------------------------------------------


def ue8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """Encode integer exponents ``e`` (scale ``2**e``) as UE8M0 scales.

    Parameters
    ----------
    exponent : integer tensor, any shape, values in [-127, 127].

    Returns
    -------
    Tensor of the same shape, dtype ``UE8M0_DTYPE`` (byte = e + 127).
    """
    if exponent.numel() and (exponent.min() < _MIN_EXPONENT or exponent.max() > _MAX_EXPONENT):
        raise ValueError(f"UE8M0 exponents must lie in [{_MIN_EXPONENT}, {_MAX_EXPONENT}]")
    raw = (exponent.to(torch.int32) + _UE8M0_BIAS).to(torch.uint8)
    return raw if UE8M0_DTYPE == torch.uint8 else raw.view(UE8M0_DTYPE)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode block scales to float32 multipliers.

    Accepts UE8M0 scales (``float8_e8m0fnu``), raw UE8M0 bytes (``uint8``, value ``2**(b-127)``)
    and plain floating-point scales (some re-exports store fp32 scales), any shape.
    """
    if scale.dtype == torch.uint8:
        return torch.ldexp(torch.ones(scale.shape, device=scale.device), scale.to(torch.int32) - _UE8M0_BIAS)
    return scale.to(torch.float32)


def _ceil_pow2_exponent(ratio: torch.Tensor) -> torch.Tensor:
    """Integer ``ceil(log2(ratio))`` for positive float32 ``ratio``, exact (no float log2)."""
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    # An exact power of two has mantissa 0.5 and needs one less doubling.
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def _block_scale_exponent(amax: torch.Tensor, max_element: float, amax_floor: float = 0.0) -> torch.Tensor:
    """Exponent of ``2**ceil(log2(max(amax, amax_floor) / max_element))``, clamped to what UE8M0 can hold.

    All-zero blocks get the smallest exponent (or the floor's); any scale reproduces zeros exactly.
    """
    ratio = (amax.to(torch.float32).clamp(min=amax_floor) / max_element).clamp(min=2.0**_MIN_EXPONENT)
    return _ceil_pow2_exponent(ratio).clamp(_MIN_EXPONENT, _MAX_EXPONENT)


# ---------------------------------------------------------------------------------------------
# Block grid helpers
# ---------------------------------------------------------------------------------------------


def block_grid(shape: tuple[int, ...] | torch.Size, block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the scale tensor for a weight of ``shape`` [..., M, K] and ``block`` (bm, bk).

    Returns ``(..., ceil(M / bm), ceil(K / bk))``; ragged edges get their own (smaller) block.
    """
    if len(shape) < 2:
        raise ValueError(f"block-scaled tensors need at least 2 dimensions, got shape {tuple(shape)}")
    bm, bk = block
    return (*shape[:-2], -(-shape[-2] // bm), -(-shape[-1] // bk))


def _check_grid(shape: tuple[int, ...], scale: torch.Tensor, block: tuple[int, int]) -> None:
    expected = block_grid(shape, block)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match weight shape {tuple(shape)} "
            f"with block {tuple(block)}: expected {expected}"
        )


def _block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Max |x| per block: [..., M, K] -> [..., Mb, Kb]. Zero padding leaves the max unchanged."""
    bm, bk = block
    *lead, m, k = x.shape
    mb, kb = block_grid(x.shape, block)[-2:]
    padded = torch.nn.functional.pad(x.abs(), (0, kb * bk - k, 0, mb * bm - m))
    return padded.reshape(*lead, mb, bm, kb, bk).amax(dim=(-3, -1))


def _expand_blocks(per_block: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Broadcast one value per block back to every element: [..., Mb, Kb] -> [..., M, K]."""
    bm, bk = block
    m, k = shape[-2:]
    return per_block.repeat_interleave(bm, dim=-2)[..., :m, :].repeat_interleave(bk, dim=-1)[..., :k]


# ---------------------------------------------------------------------------------------------
# FP8 e4m3
# ---------------------------------------------------------------------------------------------


def quantize_fp8(x: torch.Tensor, block: tuple[int, int] = V4_DENSE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to FP8 e4m3 with one UE8M0 scale per ``block``.

    Parameters
    ----------
    x : [..., M, K] floating tensor.
    block : (bm, bk); (128, 128) for V4 dense weights, (32, 32) for V4.1, (1, 32) for Engram.

    Returns
    -------
    q : [..., M, K] float8_e4m3fn, ``x / scale`` rounded to nearest (ties to even).
    scale : [..., Mb, Kb] ``UE8M0_DTYPE``, ``2 ** ceil(log2(amax / 448))`` per block.
    """
    q, exponent = quantize_fp8_exponent(x, block)
    return q, ue8m0_from_exponent(exponent)


def quantize_fp8_exponent(x: torch.Tensor, block: tuple[int, int],
                          amax_floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8` with the scales left as integer exponents (scale = ``2 ** exponent``).

    Device work only: `quantize_fp8` range-checks the exponents on the host when it encodes them
    (a sync), which a per-call activation quantiser cannot afford; the exponents here are clamped
    to [-127, 127] already, so every one of them is a valid UE8M0 byte minus 127.

    `amax_floor` raises each block's max before the scale is picked: DeepSeek's inference quantises
    activations with the floor ACTIVATION_AMAX_FLOOR (deepseek_v4 spec §13.3), weights with none.

    x : [..., M, K] floating. Returns q [..., M, K] float8_e4m3fn and exponent [..., Mb, Kb] int32.
    """
    x = x.to(torch.float32)
    exponent = _block_scale_exponent(_block_amax(x, block), FP8_E4M3_MAX, amax_floor)  # [..., Mb, Kb]
    scaled = torch.ldexp(x, -_expand_blocks(exponent, x.shape, block))
    # |scaled| <= 448 by construction; the clamp only guards against e4m3fn's NaN on overflow.
    q = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q, exponent.to(torch.int32)


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = V4_DENSE_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise block-scaled FP8: ``W = float(q) * scale`` per block.

    Parameters
    ----------
    q : [..., M, K] float8_e4m3fn.
    scale : [..., Mb, Kb] UE8M0 (``float8_e8m0fnu`` or raw ``uint8`` bytes) or floating.
    block : (bm, bk) the scales were computed over; it cannot be recovered from the shapes
        alone when the edges are ragged, so the caller passes it (config ``weight_block_size``).
    dtype : output dtype.

    Returns
    -------
    [..., M, K] tensor of ``dtype``.
    """
    _check_grid(tuple(q.shape), scale, block)
    values = q.to(torch.float32) * _expand_blocks(scale_to_float(scale), tuple(q.shape), block)
    return values.to(dtype)


# ---------------------------------------------------------------------------------------------
# FP4 e2m1 (MXFP4-style, two codes per byte, low nibble first)
# ---------------------------------------------------------------------------------------------


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round each value to the nearest e2m1 number (ties to even code) and return its 4-bit code.

    Parameters
    ----------
    x : float tensor, any shape; magnitudes above 6 saturate to 6.

    Returns
    -------
    uint8 tensor of the same shape with codes 0..15 (bit 3 = sign).
    """
    magnitude = x.to(torch.float32).abs().clamp(max=FP4_E2M1_MAX)
    # The grid is uniform on [0, 2] (step 0.5, codes 0..4), [2, 4] (step 1, codes 4..6) and
    # [4, 6] (step 2, codes 6..7). Scale each piece to unit steps by a power of two (exact), round
    # once, then add the piece's even code offset. torch.round goes half to even, so midpoints
    # land on the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
    low, high = magnitude < 2, magnitude >= 4
    steps = torch.round(torch.where(low, magnitude * 2, torch.where(high, magnitude / 2, magnitude)))
    offset = torch.where(low, 0, torch.where(high, 4, 2))
    code = (steps + offset).to(torch.uint8)
    sign = (x < 0).to(torch.uint8) << 3
    return code | sign


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """`decode_e2m1(encode_e2m1(x))` without the codes: x (any shape, float) rounded to the nearest
    e2m1 value (ties to even code, magnitudes above 6 saturate), float32. The same three pieces as
    `encode_e2m1`, each scaled to unit steps, rounded and scaled back, all exact in fp32; a negative
    x keeps its sign, so it rounds to -0.0 where the codes give code 8. About half the ops of the
    encode / decode pair, which matters where every op is a kernel launch (V4.1's cache QAT runs it
    on every cached vector of a decode step)."""
    magnitude = x.to(torch.float32).abs().clamp(max=FP4_E2M1_MAX)
    low, high = magnitude < 2, magnitude >= 4
    unit = torch.where(low, 0.5, torch.where(high, 2.0, 1.0))  # grid step of the piece: a power of two
    grid = torch.round(magnitude / unit) * unit
    return torch.where(x < 0, -grid, grid)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (uint8, any shape) -> float32 values of the e2m1 table (`E2M1_VALUES`).

    Computed from the bits rather than gathered from a table tensor: building that table would copy
    host memory to the device on every call, which a CUDA-graph capture rejects. Bits: sign (3),
    exponent (2..1), mantissa (0); exponent 0 is subnormal (m · 0.5), else 2^(e−1) · (1 + m / 2).
    """
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).to(torch.float32)
    magnitude = torch.where(e == 0, m * 0.5, torch.exp2((e - 1).to(torch.float32)) * (1 + m * 0.5))
    return torch.where((c & 8) != 0, -magnitude, magnitude)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., K] (K even) into int8 bytes [..., K/2]; element 2j is the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {codes.shape[-1]}")
    low, high = codes[..., 0::2], codes[..., 1::2]
    return (low | (high << 4)).to(torch.uint8).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., K/2] (int8, uint8 or float4_e2m1fn_x2) into uint8 codes [..., K]."""
    if packed.dtype not in PACKED_FP4_DTYPES:
        raise ValueError(f"packed FP4 must be one of {PACKED_FP4_DTYPES}, got {packed.dtype}")
    raw = packed.contiguous().view(torch.uint8)
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(*raw.shape[:-1], 2 * raw.shape[-1])


def quantize_fp4(x: torch.Tensor, block: tuple[int, int] = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to packed FP4 e2m1 with one UE8M0 scale per ``block`` (1 x 32 along K).

    Parameters
    ----------
    x : [..., M, K] floating tensor, K even.
    block : (bm, bk), (1, 32) for DeepSeek routed experts.

    Returns
    -------
    packed : [..., M, K/2] int8, two codes per byte, low nibble = even column.
    scale : [..., Mb, Kb] ``UE8M0_DTYPE``, ``2 ** ceil(log2(amax / 6))`` per block.
    """
    x = x.to(torch.float32)
    exponent = _block_scale_exponent(_block_amax(x, block), FP4_E2M1_MAX)  # [..., Mb, Kb]
    scaled = torch.ldexp(x, -_expand_blocks(exponent, x.shape, block))
    return pack_fp4(encode_e2m1(scaled)), ue8m0_from_exponent(exponent)


def dequantize_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = FP4_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise packed FP4: ``W = e2m1_table[code] * scale`` per block.

    Parameters
    ----------
    packed : [..., M, K/2] int8 / uint8 / float4_e2m1fn_x2.
    scale : [..., Mb, Kb] UE8M0 (``float8_e8m0fnu`` or ``uint8`` bytes) or floating.
    block : (bm, bk), (1, 32) for DeepSeek routed experts.
    dtype : output dtype.

    Returns
    -------
    [..., M, K] tensor of ``dtype``.
    """
    values = decode_e2m1(unpack_fp4(packed))  # [..., M, K]
    _check_grid(tuple(values.shape), scale, block)
    return (values * _expand_blocks(scale_to_float(scale), tuple(values.shape), block)).to(dtype)


# ---------------------------------------------------------------------------------------------
# Either format, chosen by the stored dtype
# ---------------------------------------------------------------------------------------------


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    fp8_block: tuple[int, int],
    fp4_block: tuple[int, int] = FP4_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise a stored weight whatever its format: e4m3 -> :func:`dequantize_fp8` with
    ``fp8_block``, packed bytes -> :func:`dequantize_fp4` with ``fp4_block``.

    weight [..., M, K] float8_e4m3fn or [..., M, K/2] packed FP4; scale [..., Mb, Kb].
    Returns [..., M, K] of ``dtype``.
    """
    if weight.dtype == FP8_DTYPE:
        return dequantize_fp8(weight, scale, fp8_block, dtype)
    if weight.dtype in PACKED_FP4_DTYPES:
        return dequantize_fp4(weight, scale, fp4_block, dtype)
    raise ValueError(f"{weight.dtype} is neither FP8 e4m3 nor packed FP4")
