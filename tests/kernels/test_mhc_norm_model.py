"""The V4 model with its sublayer norms folded into the mHC sites (`mhc_pre_norm` / `mhc_post_pre_norm`
on Triton; on CPU the interpreter, conftest.py) against the same model with them off (the unfused
pre, then the `rms_norm` op): dynamic ragged calls and the static decode step, fp32 tiny-v4; and,
with them on, no `rms_norm` call normalises with an attn_norm / ffn_norm weight (no separate launch)."""

import sys
from pathlib import Path

import pytest
import torch

from dspark.kernels import mhc_norm, triton_available
from dspark.models.deepseek_v4.static_step import StaticDecoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from model_pairs import tiny_v4_pair  # noqa: E402
from static_step_checks import run_rounds  # noqa: E402

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FOLDED = ("mhc_pre_norm", "mhc_post_pre_norm")


def pair(monkeypatch):
    return tiny_v4_pair(monkeypatch, FOLDED, DEVICE)


def sublayer_norm_calls(model, normed: list) -> int:
    """How many of the recorded `rms_norm` calls normed with one of `model`'s attn_norm / ffn_norm."""
    weights = {id(norm.weight) for layer in model.layers for norm in (layer.attn_norm, layer.ffn_norm)}
    return sum(id(w) in weights for w in normed)


@needs_triton
@torch.no_grad()
def test_dynamic_calls_with_folded_norms_follow_the_unfused_model(monkeypatch):
    (off, on), normed = pair(monkeypatch)
    assert on.layers[0].pre_op is mhc_norm.mhc_pre_norm and on.layers[0].post_pre_op is mhc_norm.mhc_post_pre_norm
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (9, 4)]
    logits = []
    for model in (off, on):
        states = [model.new_state() for _ in prompts]
        outs = [model(torch.cat(prompts), states, [len(p) for p in prompts]).logits]
        for step in range(2):  # two decode calls of both requests
            ids = torch.tensor([7 + step, 100 + step])
            outs.append(model(ids, states, [1, 1]).logits)
        logits.append(torch.cat(outs))
    torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=1e-4)
    # off: 3 calls x 2 sublayer norms per layer through the rms_norm op; on: none (folded into the sites)
    assert sublayer_norm_calls(off, normed) == 3 * 2 * len(off.layers) and sublayer_norm_calls(on, normed) == 0


@needs_triton
@torch.no_grad()
def test_static_step_with_folded_norms_follows_the_unfused_model(monkeypatch):
    (off, on), normed = pair(monkeypatch)
    outs = [torch.stack(run_rounds(StaticDecoder, model, None, rounds=1)) for model in (off, on)]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=1e-4)
    assert sublayer_norm_calls(off, normed) > 0 and sublayer_norm_calls(on, normed) == 0
