"""The V4 static decode step with the ops of `registry.NOT_YET_ON_GPU` on Triton (the batched
`index_scores`, the pool reading its slots from the rings, `compressor_pool_gather`; on CPU the
interpreter, see conftest.py) against the same step on their references: tiny-v4, fp32, verify
rounds of 4 tokens over 2 slots at different lengths, so rows see different numbers of entries."""

import dataclasses

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig, triton_available
from dspark.kernels.registry import NOT_YET_ON_GPU
from dspark.models.deepseek_v4.static_step import StaticDecoder

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from static_step_checks import run_rounds  # noqa: E402

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@torch.no_grad()
def test_static_step_with_the_not_yet_kernels_follows_the_reference():
    base = KernelConfig.for_device(DEVICE)
    assert set(NOT_YET_ON_GPU) == {"index_scores", "compressor_pool_gather"}
    outs = {}
    for impl in ("ref", "triton"):
        model = dspark.init_model("tiny-v4", seed=0, device=DEVICE, dtype=torch.float32,
                                  kernels=dataclasses.replace(base, **{op: impl for op in NOT_YET_ON_GPU}))
        assert model.layers[1].attn.indexer.scores_op.__name__ == ("index_scores_ref" if impl == "ref" else
                                                                   "index_scores")
        assert model.layers[1].attn.compressor.pools_from_rows == (impl == "triton")
        calls = []
        for layer in model.layers:
            if layer.attn.indexer is not None:
                op = layer.attn.indexer.scores_op
                layer.attn.indexer.scores_op = lambda *a, _op=op: calls.append(a[3]) or _op(*a)
        outs[impl] = torch.stack(run_rounds(StaticDecoder, model, None, rounds=2))
        assert calls and any(bool((v > 0).any()) for v in calls)  # called, with entries to see
    assert torch.allclose(outs["triton"], outs["ref"], atol=2e-4, rtol=1e-4)
