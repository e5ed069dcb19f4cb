"""The static decode step on the GPU: no host sync in the eager step, captured graphs (T = 1 and 4)
replayed on new inputs equal the eager step, and both follow the dynamic path (tiny-v4, fp32, the
Triton kernels of `KernelConfig.for_device("cuda")`)."""

import dataclasses

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig
from dspark.models.deepseek_v4.static_step import StaticDecoder
from static_step_checks import check_graph_replay


@pytest.mark.gpu
@pytest.mark.parametrize("gather", [True, False])  # False: the step's former path (copied slots, torch scores)
@torch.no_grad()
def test_static_step_graph_replay_equals_eager_without_sync(gather):
    kernels = KernelConfig.for_device("cuda")
    if not gather:
        kernels = dataclasses.replace(kernels, compressor_pool_gather="ref", index_scores="ref")
    model = dspark.init_model("tiny-v4", seed=0, device="cuda", kernels=kernels)
    check_graph_replay(model, StaticDecoder)
