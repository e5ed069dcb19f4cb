"""The static-shape decode / verify step of DeepSeek-V4.1 (`deepseek_v41/static_step.py`) against the
dynamic ragged path.

tiny-v41 (fp32, CPU, exact prefill): window 8; KV source 1 (ratio 2, Engram) read by reuse layers
2-3; KV source 4 (ratio 1, candidate source, Engram) read by reuse 5 and reindex 6 inside the pool
of 2 blocks of 4; top-k 4. Slots prefilled to 0 .. 30 tokens and decoded / verified for dozens of
positions cross ratio-2 group boundaries, candidate-block boundaries and the window many times.

Exactness runs without the cache QAT (`cache_qat=False`, see tests/models_v41/conftest.py): rounding
to the FP8/FP4 grids turns last-bit noise into whole grid steps. With QAT on, the greedy tokens
are checked. Rollback and unused slots are checked bit for bit.
"""

import sys
from pathlib import Path

import pytest
import torch

import dspark
from dspark.models.deepseek_v4.static_state import StaticShape
from dspark.models.deepseek_v41.static_step import StaticDecoderV41
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the V4 checks, shared
from static_step_checks import TOL, check_bad_inputs, check_head_weights_early, check_rollback, check_unused_slot, prefilled, row_independent_moe  # noqa: E402,F401,F811



@pytest.fixture(scope="module")
def model():
    return dspark.init_model("tiny-v41", seed=0, prefill_mode="exact", cache_qat=False)


def lockstep(model, decoder, states, starts, rounds, tokens, g):
    """`rounds` steps of `tokens` random ids per slot on both paths, accepting 1 .. tokens of them
    (so the slots' starts drift apart). Yields (static, dynamic) logits [S, T, V] and the starts."""
    n_slots = len(states)
    for _ in range(rounds):
        ids = torch.randint(0, 256, (n_slots, tokens), generator=g)
        dynamic = model(ids.reshape(-1), states, [tokens] * n_slots).logits.view(n_slots, tokens, -1)
        static = decoder.step(*decoder.plan(ids, starts))
        yield static, dynamic, starts
        accept = torch.randint(1, tokens + 1, (n_slots,), generator=g)
        for state, n in zip(states, accept.tolist()):
            state.truncate(state.length - tokens + n)
        starts = starts + accept


@pytest.mark.parametrize("tokens", [1, 4])
def test_static_v41_step_matches_dynamic_path(model, tokens):
    """Decode (T = 1) and verify (T = 4) rounds for 4 slots of different lengths (one empty): every
    round's logits equal the dynamic call's on the same tokens, through group completions of the
    ratio-2 source, new candidate blocks of the ratio-1 source and the windows' wrap-around."""
    decoder = StaticDecoderV41(model, StaticShape(slots=4, max_context=96, tokens=4))
    states, starts = prefilled(model, decoder, [0, 5, 13, 30], seed=1)
    g = torch.Generator().manual_seed(2)
    seen = set()
    for static, dynamic, at in lockstep(model, decoder, states, starts, 24 if tokens == 1 else 12, tokens, g):
        torch.testing.assert_close(static, dynamic, **TOL)
        seen.update((at % 2).tolist())
    final = [state.length for state in states]
    assert seen == {0, 1} and min(final) >= 12 and max(final) >= 48  # both parities, past 6 blocks of 4 entries


def test_static_v41_forward_returns_the_captured_streams(model):
    """`forward` with capture_layers (a drafter's context: layers 4-6 and the final streams) returns
    the dynamic call's features and hidden streams per slot, and the same logits as without capture
    (capture points get a standalone post, as in the dynamic path)."""
    decoder = StaticDecoderV41(model, StaticShape(slots=3, max_context=64, tokens=4))
    states, starts = prefilled(model, decoder, [6, 11, 20], seed=9)
    capture = (4, 5, 6, 7)
    g = torch.Generator().manual_seed(10)
    for _ in range(3):
        ids = torch.randint(0, 256, (3, 4), generator=g)
        dynamic = model(ids.reshape(-1), states, [4] * 3, capture_layers=capture)
        out = decoder.forward(*decoder.plan(ids, starts), capture_layers=capture)
        assert sorted(out.features) == list(capture)
        for i in capture:
            torch.testing.assert_close(out.features[i], dynamic.features[i].view(3, 4, 4, -1), **TOL)
        torch.testing.assert_close(out.hidden, dynamic.hidden.view(3, 4, 4, -1), **TOL)
        torch.testing.assert_close(out.logits, dynamic.logits.view(3, 4, -1), **TOL)
        starts = starts + 4
    with pytest.raises(ValueError, match=r"capture_layers \[8\]"):
        decoder.forward(*decoder.plan(ids, starts), capture_layers=(8,))


def test_static_v41_greedy_with_cache_qat():
    """With the FP8 / FP4 cache QAT on (the released numerics), greedy continuations of the static
    step are the dynamic ones and the logits stay within a few grid steps' effect."""
    qat = dspark.init_model("tiny-v41", seed=0, prefill_mode="exact")
    assert qat.cache_qat
    decoder = StaticDecoderV41(qat, StaticShape(slots=3, max_context=64, tokens=1))
    states, starts = prefilled(qat, decoder, [3, 9, 22], seed=3)
    dynamic_ids = static_ids = torch.tensor([[7], [8], [9]])
    worst = 0.0
    for _ in range(30):
        dynamic = qat(dynamic_ids.reshape(-1), states, [1] * 3).logits.view(3, 1, -1)
        static = decoder.step(*decoder.plan(static_ids, starts))
        worst = max(worst, (static - dynamic).abs().max().item())
        dynamic_ids, static_ids = dynamic.argmax(-1), static.argmax(-1)
        assert torch.equal(static_ids, dynamic_ids)
        starts = starts + 1
    assert worst < 1e-3, f"max |static − dynamic| logit with cache QAT: {worst}"


def test_static_v41_rollback_leaves_no_trace(model, row_independent_moe):
    """Rejected positions complete ratio-2 groups, add ratio-1 entries and candidate blocks, overwrite
    window rows and n-gram ids. Two runs rejecting different tokens give bit-identical logits
    afterwards, equal (to fp32 tolerance) to a run that never fed them."""
    check_rollback(StaticDecoderV41, model)


def test_static_v41_unused_slot_changes_no_other_slot(model, row_independent_moe):
    """Slot 1 holds no request and is fed junk at position 0 or elsewhere: slots 0 and 2 are unchanged."""
    check_unused_slot(StaticDecoderV41, model)


def test_static_v41_rejects_bad_inputs(model):
    decoder = StaticDecoderV41(model, StaticShape(slots=2, max_context=32, tokens=4))
    check_bad_inputs(decoder)
    with pytest.raises(ValueError, match="state must be a DecodeStateV41.*DecodeState"):
        decoder.load(0, dspark.init_model("tiny-v4", seed=0).new_state())
    long_state = model.new_state()
    model(torch.zeros(30, dtype=torch.long), [long_state], [30])
    with pytest.raises(ValueError, match="state length 30"):
        decoder.load(0, long_state)
    with pytest.raises(ValueError, match="shape must be a StaticShape"):
        StaticDecoderV41(model, (2, 32, 4))
    host = dspark.init_model("tiny-v41", seed=0, prefill_mode="exact", engram_tables="host")
    with pytest.raises(ValueError, match=r"Engram layers \[1, 4\] keep their tables in host memory"):
        StaticDecoderV41(host, StaticShape(slots=1, max_context=32, tokens=1))


def test_static_v41_picks_go_straight_into_the_planned_key_list(model, monkeypatch):
    """Each layer attends over the pool from its own window on, so its window keys are the planned
    rows as they are; an index source's selection writes its picks, offset, into the step's planned
    key list, and a layer sharing them shifts them in place by the difference of the two pool views
    (no cat, no per-layer offset ops). The step still equals the dynamic path."""
    from dspark.models.deepseek_v41 import static_step

    shifts = []
    shared_keys = static_step.shared_keys
    monkeypatch.setattr(static_step, "shared_keys", lambda shared, window, base: shifts.append(
        (shared.base, base)) or shared_keys(shared, window, base))
    decoder = StaticDecoderV41(model, StaticShape(slots=2, max_context=96, tokens=1))
    states, starts = prefilled(model, decoder, [7, 20], seed=3)
    g = torch.Generator().manual_seed(4)
    for static, dynamic, _ in lockstep(model, decoder, states, starts, 3, 1, g):
        torch.testing.assert_close(static, dynamic, **TOL)
    sharing = sum(1 for layer in model.layers if layer.attn.ratio and layer.attn.indexer is None)
    assert 0 < sharing and len(shifts) == 3 * sharing
    assert any(before != after for before, after in shifts)  # the in-place shift is exercised


def test_head_weights_early_changes_the_order_not_the_bits(model, monkeypatch):
    check_head_weights_early(StaticDecoderV41, model, monkeypatch)
