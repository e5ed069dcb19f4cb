"""The static step's own ops on Triton (the batched `index_scores`, the pool reading its slots from
the rings, `compressor_pool_gather`, V4.1's `engram_rows`; on CPU the interpreter, see conftest.py) against their references, where the models use them: the V4 and V4.1 static decode steps (tiny configs,
fp32, verify rounds of 4 tokens over 2 slots at different lengths, so rows see different numbers of
entries) and the padded indexer pass of a ragged decode call."""

import dataclasses

import pytest
import torch

import dspark
from dspark.kernels import KernelConfig, triton_available
from dspark.models.deepseek_v4.static_step import StaticDecoder
from dspark.models.deepseek_v41.static_step import StaticDecoderV41

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from static_step_checks import run_rounds  # noqa: E402
from test_linear import record_launches  # noqa: E402 (tests/kernels is on sys.path: prepend mode)

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed; pip install -e '.[gpu]'")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STATIC_STEP_OPS = ("compressor_pool_gather", "index_scores", "compressor_project", "compressor_project_fp32", "norm_rope",
                   "engram_rows")


@needs_triton
@torch.no_grad()
def test_static_step_with_its_kernels_follows_the_reference():
    base = KernelConfig.for_device(DEVICE)
    outs = {}
    for impl in ("ref", "triton"):
        model = dspark.init_model("tiny-v4", seed=0, device=DEVICE, dtype=torch.float32,
                                  kernels=dataclasses.replace(base, **{op: impl for op in STATIC_STEP_OPS}))
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


def _models(name, **options):
    """(reference model, model with the static step's ops on Triton), equal weights."""
    base = KernelConfig.for_device(DEVICE)
    return [dspark.init_model(name, seed=0, device=DEVICE, dtype=torch.float32,
                              kernels=dataclasses.replace(base, **{op: impl for op in STATIC_STEP_OPS}), **options)
            for impl in ("ref", "triton")]


@needs_triton
@torch.no_grad()
def test_static_v41_step_with_its_kernels_follows_the_reference(monkeypatch):
    """Also V4.1's ratio-2 compressor projections stored into their rings by `_project_kernel`: the
    tiny model's K = 64 is below the kernel's range, so `project_pays` is widened here to every row
    count the kernel takes."""
    from dspark.kernels import linear

    monkeypatch.setattr(linear, "project_pays", lambda rows, width, n_in: 1 <= rows <= linear.PROJECT_MAX_ROWS)
    launches = record_launches(monkeypatch, "launch_project_fp32")
    ref, fused = _models("tiny-v41", prefill_mode="exact", cache_qat=False)
    outs = []
    for model in (ref, fused):
        launches.clear()
        outs.append(torch.stack(run_rounds(StaticDecoderV41, model, None, rounds=2)))
        assert bool(launches) == (model is fused)
    assert any(k["out_rows"] is not None for k in launches)  # the static step's ring stores
    assert torch.allclose(outs[1], outs[0], atol=2e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
@torch.no_grad()
def test_padded_indexer_pass_with_index_scores_follows_the_reference(name):
    """A ragged decode call of 3 requests at different lengths: the indexers score them in one padded
    `index_scores` call (`padded_index_scores`)."""
    options = dict(prefill_mode="exact", cache_qat=False) if name == "tiny-v41" else {}
    logits = []
    for model in _models(name, **options):
        calls = []
        for module in model.modules():
            if hasattr(module, "scores_op"):
                module.scores_op = lambda *a, _op=module.scores_op: calls.append(a[0].shape[0]) or _op(*a)
        g = torch.Generator().manual_seed(3)
        states = [model.new_state() for _ in range(3)]
        for state, n in zip(states, (9, 30, 17)):
            model(torch.randint(0, 256, (n,), generator=g), [state], [n])
        calls.clear()  # the prefills above ran one request each
        logits.append(model(torch.randint(0, 256, (3,), generator=g), states, [1, 1, 1]).logits)
        assert calls and all(groups == 3 for groups in calls)  # one padded call for the 3 requests
    assert torch.allclose(logits[1], logits[0], atol=2e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("overlap,rate", [(True, 4), (False, 8)])  # a CSA / indexer compressor, an HCA one
@pytest.mark.parametrize("tokens", [1, 4])  # a decode row, a verify block of 4 rows (one projection launch)
@torch.no_grad()
def test_batch1_compressor_update_writes_from_its_kernels(overlap, rate, tokens, monkeypatch):
    """`update_compressor` at `tokens` rows of one request, 2048-wide compressor (the projection kernel pays):
    with the Triton ops the projection stores its rows in the rings and the pool stores the rotated
    entry at its row, so the update makes no `index_copy_` and no separate RoPE launch (the reference
    makes 3 copies and 1 rotation); rings and entries equal the reference's."""
    from dspark.models.deepseek_v4.compressor import Compressor
    from dspark.models.deepseek_v4.static_index import StepIndex, StepTables
    from dspark.models.deepseek_v4.static_state import StaticCompressorState, StaticShape
    from dspark.models.deepseek_v4.static_step import update_compressor

    model = dspark.init_model("tiny-v4", seed=0, device=DEVICE, dtype=torch.float32)
    rope = model.layers[1].attn.rope  # rd 8
    fused_ops = KernelConfig(compressor_project="triton", compressor_pool_gather="triton", rope="triton")
    torch.manual_seed(2)
    modules = [Compressor(2048, 32, rate, overlap, 1e-6, torch.float32, DEVICE, kernels=k)
               for k in (KernelConfig(), fused_ops)]
    for p in modules[0].parameters():
        p.normal_()
    modules[1].load_state_dict(modules[0].state_dict())
    shape = StaticShape(slots=2, max_context=64, tokens=tokens)
    tables = StepTables(model, shape)  # the model's RoPE table groups; ranges up to 64 (> 2 · rate)
    g = torch.Generator().manual_seed(5)
    states = []
    for _ in modules:  # random rings (earlier rows of the groups) and poisoned entries
        entries = torch.full((2, 64 // rate + 1, 32), float("nan"), device=DEVICE)
        state = StaticCompressorState(shape, rate, overlap, 32, entries, torch.float32, DEVICE)
        state.kv.data.copy_(torch.randn(state.kv.data.shape, generator=g))
        state.score.data.copy_(torch.randn(state.score.data.shape, generator=g))
        states.append(state)
    states[1].kv.data.copy_(states[0].kv.data)
    states[1].score.data.copy_(states[0].score.data)
    x = torch.randn(tokens, 2048, generator=g).to(DEVICE)
    position = 3 * rate - 1  # the last row of group 2: the step completes entry 2 of slot 0
    positions = torch.arange(position - tokens + 1, position + 1, device=DEVICE)[None]
    counts = []
    for module, state in zip(modules, states):
        calls = {"index_copy_": 0, "rope": 0}
        index_copy = torch.Tensor.index_copy_
        monkeypatch.setattr(torch.Tensor, "index_copy_",
                            lambda *a: calls.__setitem__("index_copy_", calls["index_copy_"] + 1) or index_copy(*a))
        module.rope_op = lambda *a, _op=module.rope_op: calls.__setitem__("rope", calls["rope"] + 1) or _op(*a)
        update_compressor(module, state, StepIndex(positions[:, 0], tokens, tables), x, rope)
        monkeypatch.undo()
        counts.append(calls)
    assert counts == [{"index_copy_": 3, "rope": 1}, {"index_copy_": 0, "rope": 0}]
    ref, fused = states
    for got, want in ((fused.kv.data, ref.kv.data), (fused.score.data, ref.score.data)):  # rows ~45: x·w of 2048
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
    written = ~ref.entries.isnan()
    assert written.sum() == 32 and written[0, 2].all()  # entry 2 of slot 0 only; slot 1 untouched
    assert torch.equal(written, ~fused.entries.isnan())
    assert torch.allclose(fused.entries[written], ref.entries[written], rtol=1e-4, atol=1e-5)
