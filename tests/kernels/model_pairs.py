"""A pair of tiny-v4 models that differ in some ops' implementation, with their RMSNorm calls spied on
(the model tests of the ops that fold a norm in: `mhc_norm`, `hc_head_norm`)."""

from __future__ import annotations

import dataclasses

import torch

import dspark
from dspark.kernels import KernelConfig


def tiny_v4_pair(monkeypatch, ops: tuple[str, ...], device: str):
    """((`ops` at "ref", `ops` at "triton") tiny-v4 fp32 models with equal weights, every other op as
    the device's default (the references on CPU), and the list of weights the models' `rms_norm` op is
    called with (the op is wrapped before the models pick it up)."""
    from dspark.kernels import rms_norm

    normed = []
    for name in ("rms_norm", "rms_norm_ref"):
        op = getattr(rms_norm, name)
        monkeypatch.setattr(rms_norm, name,
                            lambda x, weight, *, _op=op, **kw: normed.append(weight) or _op(x, weight, **kw))
    base = KernelConfig.for_device(device)
    models = [dspark.init_model("tiny-v4", seed=0, device=device, dtype=torch.float32,
                                kernels=dataclasses.replace(base, **{op: impl for op in ops}))
              for impl in ("ref", "triton")]
    return models, normed
