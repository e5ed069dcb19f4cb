"""Quantisation-aware-training formats of the DeepSeek-V4.1 caches (deepseek_v41 spec §11.3).

V4.1 was trained with its caches quantised, so the reference quantises and immediately
dequantises these vectors: the values the model sees are exactly what an FP8/FP4 cache would hold.
`CacheQuant` applies them, or nothing when a model is built with `cache_qat=False`: rounding to a
grid is discontinuous, so two computations of one value that differ by fp32 noise (a row computed
in a batch of 13 or of 60) can land on neighbouring grid points; exactness tests of the state
logic therefore run without it, and the formats are tested on their own.

=====================  =================  ========================  ========================
vector                 element            scale per block           block (last dim)
=====================  =================  ========================  ========================
window KV (all dims)   FP8 e4m3           UE8M0, amax >= 1e-4       32
indexer q and keys     FP4 e2m1           UE8M0, amax >= 6·2^-126   32
compressed KV entries  FP4 e2m1           E4M3, amax >= 6·2^-9      16
=====================  =================  ========================  ========================

UE8M0 scales are `2^ceil(log2(amax / max_element))`; the E4M3 scale is `e4m3(amax / 6)` rounded to
nearest, which may round down, so a block's largest value can saturate at ±6·s (amax 10 gives
s = 1.625 and 10 -> 9.75). Elements round to nearest, ties to even. All functions take
[..., d] tensors with d a multiple of the block and return the dequantised values in x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dspark.quant import FP4_E2M1_MAX, FP8_DTYPE, FP8_E4M3_MAX, round_e2m1


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., d] -> fp32 [..., d / block, block]."""
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return x.float().unflatten(-1, (-1, block))


def _pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(t)) for positive fp32 t, exact (frexp, no float log2)."""
    mantissa, exponent = torch.frexp(t)  # t = mantissa · 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(t), torch.where(mantissa == 0.5, exponent - 1, exponent))


def fp8_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 with a power-of-two scale per `block` values (window KV). x [..., d] -> [..., d]."""
    blocks = _blocks(x, block)
    scale = _pow2_ceil(blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4) / FP8_E4M3_MAX)
    q = (blocks / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE).float()
    return (q * scale).flatten(-2).to(x.dtype)


def _fp4(blocks: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (round_e2m1(blocks / scale) * scale).flatten(-2).to(dtype)


def fp4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 e2m1 with a power-of-two scale per `block` values (indexer q, index keys)."""
    blocks = _blocks(x, block)
    scale = _pow2_ceil(blocks.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0**-126) / FP4_E2M1_MAX)
    return _fp4(blocks, scale, x.dtype)


def fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP4 e2m1 with an e4m3 (not power-of-two) scale per `block` values (compressed KV entries)."""
    blocks = _blocks(x, block)
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0**-9)
    # Saturate before the cast: torch's CPU float8 cast saturates but its CUDA cast gives NaN past 448.
    scale = (amax / FP4_E2M1_MAX).clamp(max=FP8_E4M3_MAX).to(FP8_DTYPE).float()
    return _fp4(blocks, scale, x.dtype)


def _round_ref(x: torch.Tensor, *, fmt: str, out: torch.Tensor | None = None,
               out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The formats above by name: `dspark.kernels.cache_round`'s op signature, its reference (with
    `out` [R, d] and `out_rows` [n], row i of x viewed as [n, d] goes to out[out_rows[i]])."""
    y = {"fp8_ue8m0": fp8_ue8m0, "fp4_ue8m0": fp4_ue8m0, "fp4_e4m3": fp4_e4m3}[fmt](x)
    if out is None:
        return y
    return out.index_copy_(0, out_rows.long(), y.reshape(-1, x.shape[-1]).to(out.dtype))


@dataclass(frozen=True)
class CacheQuant:
    """The three cache formats of one model, or identities when `enabled` is False. `round_op` is
    the kernel registry's `cache_round` (x, *, fmt) -> rounded x (the model passes the one its
    `KernelConfig` picks: one launch per call on CUDA); default the torch formats above."""

    enabled: bool = True
    round_op: Callable[..., torch.Tensor] = _round_ref

    def window(self, kv: torch.Tensor) -> torch.Tensor:
        return self.round_op(kv, fmt="fp8_ue8m0") if self.enabled else kv

    def window_rows(self, kv: torch.Tensor, out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`window(kv)` [n, d] written to out[rows] (a static step's window ring, [R, d]; on Triton in
        the rounding kernel's own stores, so no copy follows)."""
        if self.enabled:
            return self.round_op(kv, fmt="fp8_ue8m0", out=out, out_rows=rows)
        return out.index_copy_(0, rows.long(), kv.to(out.dtype))

    def entries(self, latents: torch.Tensor) -> torch.Tensor:
        return self.round_op(latents, fmt="fp4_e4m3") if self.enabled else latents

    def index(self, x: torch.Tensor) -> torch.Tensor:
        return self.round_op(x, fmt="fp4_ue8m0") if self.enabled else x
