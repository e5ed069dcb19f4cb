"""Seeded random weights for DeepSeek-V4.1 test and smoke models, chosen so that every branch
moves the logits (a wiring mistake must show up in a test).

Values by parameter name (N(mean, std)): linear weights and mHC `fn` N(0, 1/√fan_in) so
activations stay O(1); the token embedding and Engram table rows N(0, 1); norm weights and the
Engram `q_weight` / `k_weight` 1 + N(0, 0.1); attention sinks and mHC `base` N(0, 0.5); mHC
`scale` U(0.5, 1.5); router `bias` / `bias_vl` N(0, 0.1).
"""

from __future__ import annotations

import torch


def random_value(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A sensitive random fp32 value for the parameter called `name` (see the module docstring)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("_scale"):  # mHC scales, never block scales
        return torch.rand(shape, generator=g) + 0.5
    if leaf == "attn_sink" or leaf.endswith("_base"):
        return torch.randn(shape, generator=g) * 0.5
    if leaf in ("bias", "bias_vl"):
        return torch.randn(shape, generator=g) * 0.1
    if name.endswith("norm.weight") or leaf in ("q_weight", "k_weight"):
        return 1 + torch.randn(shape, generator=g) * 0.1
    if name == "embed.weight" or name.endswith("engram.embed.weight"):
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) * shape[-1] ** -0.5
