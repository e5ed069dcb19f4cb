"""The V4 static decode step with the batched `index_scores` kernel (Triton; on CPU the interpreter,
see conftest.py) against the same step with the op's reference: tiny-v4, fp32, verify rounds of 4
tokens over 2 slots at different lengths, so rows see different numbers of entries (some none)."""

import dataclasses

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig, triton_available
from dspark.models.deepseek_v4.static_step import StaticDecoder

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from static_step_checks import run_rounds  # noqa: E402

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@torch.no_grad()
def test_static_step_with_the_index_scores_kernel_follows_the_reference():
    base = KernelConfig.for_device(DEVICE)
    outs = {}
    for impl in ("ref", "triton"):
        model = dspark.init_model("tiny-v4", seed=0, device=DEVICE, dtype=torch.float32,
                                  kernels=dataclasses.replace(base, index_scores=impl))
        assert model.layers[1].attn.indexer.scores_op.__name__ == ("index_scores_ref" if impl == "ref" else
                                                                   "index_scores")
        calls = []
        for layer in model.layers:
            if layer.attn.indexer is not None:
                op = layer.attn.indexer.scores_op
                layer.attn.indexer.scores_op = lambda *a, _op=op: calls.append(a[3]) or _op(*a)
        outs[impl] = torch.stack(run_rounds(StaticDecoder, model, None, rounds=2))
        assert calls and any(bool((v > 0).any()) for v in calls)  # called, with entries to see
    assert torch.allclose(outs["triton"], outs["ref"], atol=2e-4, rtol=1e-4)
