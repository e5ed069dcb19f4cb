"""Auxiliary-loss-free expert balancing for pretraining (DeepSeek-V3 §2.1.2, kept by V4 and V4.1).

A score-routed gate picks its top-K experts by `score + bias`; the bias takes no gradient. After
each optimiser step, every expert's bias moves by `rate` towards balance:

    bias_e += rate · sign(mean load − load_e)        load_e = tokens routed to e in the step

Gates are found by what they expose (a `bias` [E] parameter next to a `top_k`, output
`(weights, expert ids [N, K])`) rather than by class, so V4 and V4.1 routers both qualify; hash
routed gates (no bias) are left alone. Counting happens in forward hooks that exist only inside
:meth:`ExpertBalancer.observe`, so evaluation passes never move the biases.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def score_gates(model: nn.Module) -> dict[str, nn.Module]:
    """{name: gate} of every biased top-k router in `model` (sorted by name)."""
    gates = {}
    for name, module in model.named_modules():
        bias = getattr(module, "bias", None)
        if isinstance(bias, nn.Parameter) and bias.dim() == 1 and hasattr(module, "top_k") \
                and not getattr(module, "hashed", False):
            gates[name] = module
    return dict(sorted(gates.items()))


class ExpertBalancer:
    """Holds the routing biases of `model` out of the optimiser and updates them by load."""

    def __init__(self, model: nn.Module, rate: float = 1e-3):
        if not rate >= 0:
            raise ValueError(f"balance rate: {rate} must be >= 0")
        self.rate = rate
        self.gates = score_gates(model)
        self.counts: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for gate in self.gates.values():
                # A random starting bias would skew routing for the whole run; start neutral.
                gate.bias.zero_()
                gate.bias.requires_grad_(False)
                bias_vl = getattr(gate, "bias_vl", None)  # V4.1 image-token bias: no images here
                if isinstance(bias_vl, nn.Parameter):
                    bias_vl.zero_()
                    bias_vl.requires_grad_(False)

    @contextmanager
    def observe(self) -> Iterator[None]:
        """Count routed tokens per expert during the forward calls made inside the block."""
        handles = [gate.register_forward_hook(self._hook(name)) for name, gate in self.gates.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, name: str):
        def count(gate: nn.Module, inputs, output) -> None:
            experts = output[1].detach().flatten()  # [N·K]
            load = torch.bincount(experts, minlength=gate.bias.numel()).float()
            self.counts[name] = self.counts[name] + load if name in self.counts else load
        return count

    @torch.no_grad()
    def update(self) -> torch.Tensor | None:
        """Apply one bias step from the counts since the last update. Returns the worst
        max-load / mean-load ratio over the gates as a 0-d tensor (1 = balanced; read it only when
        logging, reading it syncs the device), or None when nothing was routed."""
        ratios = []
        for name, load in self.counts.items():
            mean = load.mean()
            self.gates[name].bias.add_(torch.sign(mean - load) * self.rate)
            ratios.append(load.max() / mean.clamp(min=1e-9))
        self.counts.clear()
        return torch.stack(ratios).max() if ratios else None
