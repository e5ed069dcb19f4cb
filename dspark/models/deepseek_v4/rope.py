"""Partial, interleaved rotary embedding on the *last* rotary dims of a vector (spec §7.3).

Channel pairs (2i, 2i+1) of the trailing `rd` dims are rotated by angle `p·θ_i`, i < rd/2; the
leading `d − rd` "nope" dims are untouched. DeepSeek-V4 uses two tables: "main" (plain RoPE,
base 10000) for sliding-window-only layers and "compress" (base 160000 with YaRN, no mscale) for
CSA / HCA layers, where it rotates queries, window latents, compressed entries and indexer q/k.
The inverse rotation (angle −p·θ) undoes the rotation that values carried into the attention output.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dspark.kernels.rope_ref import rope_ref
from dspark.models.deepseek_v4.config import RopeParameters


def inverse_frequencies(params: RopeParameters, head_dim: int) -> torch.Tensor:
    """θ_i for i < rd/2, fp32 [rd/2]; YaRN blends θ and θ/factor with a linear ramp (spec §7.3).

    For the V4 compress rope (rd 64, base 160000, factor 16, L0 65536, β 32/1) the ramp runs from
    index 15 to 25: θ'[0:3] = [1.0, 0.687656, 0.472871].
    """
    rd = int(head_dim * params.partial_rotary_factor)
    theta = 1.0 / (params.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))  # [rd/2]
    if params.rope_type != "yarn":
        return theta
    low, high = _yarn_correction_range(params, rd)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(rd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp = 0 keeps the original (high-frequency) θ, ramp = 1 interpolates to θ / factor.
    return (theta / params.factor) * ramp + theta * (1 - ramp)


def _yarn_correction_range(params: RopeParameters, rd: int) -> tuple[float, float]:
    """Dimension indices where YaRN's interpolation starts (β_fast) and is complete (β_slow)."""

    def dim_for(rotations: float) -> float:
        # Dimension whose wavelength fits `rotations` times into the original context length.
        ratio = params.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rd * math.log(ratio) / (2 * math.log(params.rope_theta))

    low, high = dim_for(params.beta_fast), dim_for(params.beta_slow)
    if params.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rd - 1)


class Rope(nn.Module):
    """One RoPE table: θ as a non-persistent fp32 buffer (not a checkpoint key).

    The module's dtype is fixed at construction: do not cast the model with `.to(dtype)`, which
    would round θ.
    """

    def __init__(self, params: RopeParameters, head_dim: int, device=None):
        super().__init__()
        self.rope_dim = int(head_dim * params.partial_rotary_factor)
        self.attention_factor = params.attention_factor
        self.register_buffer("inv_freq", inverse_frequencies(params, head_dim).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of p·θ in fp32, each [*positions.shape, rd/2]."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


class RopeTable:
    """`Rope.cos_sin` of every position 0 .. C−1, computed once, so that a step gathers its rows in
    one launch instead of running the six ops of `cos_sin` per call.

    The rows are the values `rope.cos_sin` gives each position (the same ops, element by element),
    so a gathered row equals a direct call bit for bit. Memory: C · rd · 4 bytes (rd/2 = 32 at
    C = 128K: 32 MiB). Built outside any captured step (it allocates); `cos_sin` is capturable.

    Shape symbols: C positions, rd/2 rotated channel pairs.
    """

    def __init__(self, rope: Rope, length: int):
        cos, sin = rope.cos_sin(torch.arange(length, device=rope.inv_freq.device))
        self.data = torch.stack((cos, sin))  # [2, C, rd/2] fp32: one gather reads both

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [*] long, each in [0, C) (not checked: that would sync) -> (cos, sin), each
        [*, rd/2] fp32 and contiguous, equal to `rope.cos_sin(positions)`."""
        rows = self.data.index_select(1, positions.reshape(-1))  # [2, n, rd/2]
        rows = rows.view(2, *positions.shape, rows.shape[-1])
        return rows[0], rows[1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing `2·cos.shape[-1]` dims of `x` pairwise; pass `-sin` for the inverse.

    x: [..., d] (any dtype); cos, sin: fp32, broadcastable to [..., rd/2]. The rotation runs in
    fp32 and the result is cast back to x's dtype. Returns a new tensor. This is the torch
    reference of the kernel registry's `rope` op; modules built with a `KernelConfig` call the op
    it picks (`get_op(kernels, "rope")`, one fused kernel on CUDA) instead.
    """
    return rope_ref(x, cos, sin)
