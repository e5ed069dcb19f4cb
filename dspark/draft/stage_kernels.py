"""Which implementation a DSpark draft stage runs for each fused op: the target's choice, or the
torch references while autograd records.

A stage takes the `KernelConfig` of the target it drafts for (`target.kernels`: fused Triton on
CUDA, references on CPU, `NOT_YET_ON_GPU` ops on their references). The stage's ops are the ones
the target's layers already run through the registry:

* the mHC sites: the attention site's pre, the attention's post fused with the MoE site's pre, the
  MoE's post (`mhc_pre` / `mhc_post_pre` / `mhc_post` for V4 stages, `mhc_v41_pre` /
  `mhc_v41_post_pre` / `mhc_post` for V4.1 stages);
* the attention core `sparse_attention` and the inverse RoPE + grouped `wo_a` (`grouped_wo_a`);
* the MoE (`fused_moe`, decided inside the target's `MoE` module, built with the same config).

The stages are also trained, and the Triton ops have no backward. The rule: **while autograd is
recording (`torch.is_grad_enabled()`), a stage runs the torch references**, whatever its config;
with gradients off (`torch.no_grad`, `torch.inference_mode`: the drafter's `observe`/`propose`,
the engine) it runs the config's choice. So one drafter object serves both, e.g. a drafter loaded
on a GPU and then trained further (`train-draft --init-from`), and training never differentiates
through an op that would silently drop its gradient. The references are the stages' former torch
code op for op, so the training loss does not change by a bit.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from dspark.kernels import KernelConfig, get_op

V4_SITES = ("mhc_pre", "mhc_post_pre")  # V4 blocks: each site collapses with its own pre
V41_SITES = ("mhc_v41_pre", "mhc_v41_post_pre")  # V4.1 blocks: single-pass mHC, carried pre


class StageOps(NamedTuple):
    """One set of implementations (signatures as in `dspark.kernels`); `reference` is True when
    every op is the torch reference (the stage then also runs its MoE's reference path)."""

    pre: Callable
    post_pre: Callable
    post: Callable
    attend: Callable
    wo_a: Callable
    reference: bool


def stage_ops(kernels: KernelConfig, sites: tuple[str, str]) -> StageOps:
    """The ops `kernels` selects for a stage whose mHC sites are `sites` (`V4_SITES`, `V41_SITES`)."""
    pre, post_pre = sites
    names = (pre, post_pre, "mhc_post", "sparse_attention", "grouped_wo_a")
    ops = [get_op(kernels, name) for name in names]
    reference = all(getattr(kernels, name) == "ref" for name in (*names, "fused_moe"))
    return StageOps(*ops, reference=reference)


class StageKernels:
    """A stage's kernel choice: `kernels` (validated) for inference, the references under autograd."""

    def __init__(self, kernels: KernelConfig, sites: tuple[str, str]):
        if not isinstance(kernels, KernelConfig):
            raise ValueError(f"kernels must be a dspark.kernels.KernelConfig, got {kernels!r}")
        self.config = kernels
        self.chosen = stage_ops(kernels, sites)
        self.references = stage_ops(KernelConfig(), sites)

    def current(self) -> StageOps:
        """The ops for the call about to run (module docstring: references while autograd records)."""
        return self.references if torch.is_grad_enabled() else self.chosen
