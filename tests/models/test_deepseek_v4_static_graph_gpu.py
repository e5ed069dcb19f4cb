"""The static decode step on the GPU: no host sync in the eager step, captured graphs (T = 1 and 4)
replayed on new inputs equal the eager step, and both follow the dynamic path (tiny-v4, fp32, the
Triton kernels of `KernelConfig.for_device("cuda")`)."""

import dataclasses

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig
from dspark.kernels.registry import NOT_YET_ON_GPU
from dspark.models.deepseek_v4.static_step import StaticDecoder
from static_step_checks import check_graph_replay


@pytest.mark.gpu
@pytest.mark.parametrize("not_yet", [False, True])  # True: also the ops of registry.NOT_YET_ON_GPU on Triton
@torch.no_grad()
def test_static_step_graph_replay_equals_eager_without_sync(not_yet):
    kernels = KernelConfig.for_device("cuda")
    if not_yet:
        kernels = dataclasses.replace(kernels, **{op: "triton" for op in NOT_YET_ON_GPU})
    model = dspark.init_model("tiny-v4", seed=0, device="cuda", kernels=kernels)
    check_graph_replay(model, StaticDecoder)
