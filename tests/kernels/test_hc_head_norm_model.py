"""The V4 model with its output collapse and final norm folded (`hc_head_norm` on Triton; on CPU the
interpreter, conftest.py) against the same model with the op at "ref" (torch `hc_head`, then the
`rms_norm` op): dynamic ragged calls, the MTP block and the static decode step, fp32 tiny-v4; with
the op on, no `rms_norm` call normalises with the model's or the MTP block's final `norm` weight."""

import sys
from pathlib import Path

import pytest
import torch

from dspark.kernels import hc_head_norm, triton_available
from dspark.models.deepseek_v4.static_step import StaticDecoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from model_pairs import tiny_v4_pair  # noqa: E402
from static_step_checks import run_rounds  # noqa: E402

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pair(monkeypatch):
    return tiny_v4_pair(monkeypatch, ("hc_head_norm",), DEVICE)


def final_norm_calls(model, normed: list) -> int:
    """How many of the recorded `rms_norm` calls normed with the model's or an MTP block's final norm."""
    weights = {id(model.norm.weight)} | {id(mtp.norm.weight) for mtp in model.mtp}
    return sum(id(w) in weights for w in normed)


@needs_triton
@torch.no_grad()
def test_dynamic_and_mtp_calls_with_the_folded_head_follow_the_unfused_model(monkeypatch):
    (off, on), normed = pair(monkeypatch)
    assert on.head_norm_op is hc_head_norm.hc_head_norm and on.mtp[0].head_norm_op is hc_head_norm.hc_head_norm
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (9, 4)]
    next_ids = torch.randint(0, 256, (13,), generator=g)
    logits = []
    for model in (off, on):
        states = [model.new_state() for _ in prompts]
        out = model(torch.cat(prompts), states, [len(p) for p in prompts])
        outs = [out.logits, model(torch.tensor([7, 100]), states, [1, 1]).logits]
        mtp_states = [model.new_mtp_state() for _ in prompts]
        outs.append(model.forward_mtp(out.hidden, next_ids, mtp_states, [len(p) for p in prompts]).logits)
        logits.append(torch.cat(outs))
    torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=1e-4)
    # off: 2 main calls + 1 MTP call through the rms_norm op with a final norm; on: none (folded)
    assert final_norm_calls(off, normed) == 3 and final_norm_calls(on, normed) == 0


@needs_triton
@torch.no_grad()
def test_static_step_with_the_folded_head_follows_the_unfused_model(monkeypatch):
    (off, on), normed = pair(monkeypatch)
    outs = [torch.stack(run_rounds(StaticDecoder, model, None, rounds=1)) for model in (off, on)]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=1e-4)
    assert final_norm_calls(off, normed) > 0 and final_norm_calls(on, normed) == 0
