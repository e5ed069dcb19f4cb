"""Block-scaled FP8 weights as the Triton kernels consume them.

V4 stores dense linears as FP8 e4m3 with one UE8M0 power-of-two scale per 128×128 block
(deepseek_v4 spec §13.3), V4.1 per 32×32 block (MXFP8, deepseek_v41 spec §11.2). The codec itself
(quantise, dequantise, scale decoding) lives in `dspark.quant`, the one place for FP8 scales; this
wrapper only bundles a weight's bytes with its block size and exposes the scales as raw exponent
bytes, which is what the kernels load (2^(byte − 127) is built from the byte by a shift).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark import quant


@dataclass(frozen=True)
class FP8BlockWeight:
    """W = float(data) · 2^(scale − 127) per B×B tile.

    data : [..., out, in] float8_e4m3fn; scale : [..., ⌈out/B⌉, ⌈in/B⌉] uint8 exponent bytes
    (float8_e8m0fnu, the checkpoint dtype, is accepted and viewed as its bytes); block : B, a power
    of two >= 16 (the kernels' K-tile divides it): 128 for V4, 32 for V4.1.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: int

    def __post_init__(self) -> None:
        if self.data.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8BlockWeight.data must be float8_e4m3fn, got {self.data.dtype}")
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"FP8BlockWeight.block must be a power of two >= 16, got {self.block}")
        if self.scale.dtype not in (torch.uint8, quant.UE8M0_DTYPE):
            raise ValueError(f"FP8BlockWeight.scale must be uint8 or float8_e8m0fnu, got {self.scale.dtype}")
        object.__setattr__(self, "scale", self.scale.view(torch.uint8))  # same bytes, integer view
        want = quant.block_grid(self.data.shape, (self.block, self.block))
        if tuple(self.scale.shape) != want:
            raise ValueError(f"FP8BlockWeight.scale must be {want} for data {tuple(self.data.shape)} "
                             f"and block {self.block}, got {tuple(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, index: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense weight [..., out, in] (of expert `index` when given) in `dtype`."""
        data, scale = (self.data, self.scale) if index is None else (self.data[index], self.scale[index])
        return quant.dequantize_fp8(data, scale, (self.block, self.block), dtype=dtype)

    @classmethod
    def quantize(cls, weight: torch.Tensor, block: int) -> FP8BlockWeight:
        """Quantise [..., out, in] with scales 2^⌈log2(amax/448)⌉ per block (spec §13.3)."""
        data, scale = quant.quantize_fp8(weight, (block, block))
        return cls(data, scale, block)
