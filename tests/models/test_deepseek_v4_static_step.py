"""The static-shape decode / verify step (`static_step.py`) against the dynamic ragged path.

tiny-v4 (fp32, CPU): window 8, CSA rate 4 (top-k 3), HCA rate 8, so a few dozen steps cross many
compression boundaries of every layer type. The static step attends over fixed-width key lists
(extra −1 columns) and scores the indexer keys of all slots in one grouped pass, so its sums differ
from the dynamic path's in the last bits: logits agree to fp32 tolerance, not bit for bit, and
greedy continuations are identical. Rollback and unused slots are checked bit for bit.
"""

import pytest
import torch

import dspark
from dspark.models.deepseek_v4.static_state import StaticShape
from dspark.models.deepseek_v4.static_step import StaticDecoder
from static_step_checks import TOL, check_bad_inputs, check_head_weights_early, check_rollback, check_unused_slot, prefilled, row_independent_moe  # noqa: F401 (fixture)



@pytest.fixture(scope="module")
def model():
    return dspark.init_model("tiny-v4", seed=0)


@pytest.mark.parametrize("tokens", [1, 4])
def test_static_step_matches_dynamic_path(model, tokens):
    """Decode (T = 1) or verify (T = 4) rounds for 4 slots of different lengths (one empty): every
    round's logits equal the dynamic call's on the same tokens (accepting a varying number of them,
    so the starts drift apart and every layer type completes entries at different steps)."""
    decoder = StaticDecoder(model, StaticShape(slots=4, max_context=128, tokens=4))
    states, starts = prefilled(model, decoder, [0, 5, 13, 30], seed=1)
    g = torch.Generator().manual_seed(2)
    for round_ in range(24 if tokens == 1 else 14):
        ids = torch.randint(0, 256, (4, tokens), generator=g)
        dynamic = model(ids.reshape(-1), states, [tokens] * 4).logits.view(4, tokens, -1)
        static = decoder.step(*decoder.plan(ids, starts))
        torch.testing.assert_close(static, dynamic, **TOL)
        accept = torch.randint(1, tokens + 1, (4,), generator=g) if tokens > 1 else torch.ones(4, dtype=torch.long)
        for state, n in zip(states, accept.tolist()):
            state.truncate(state.length - tokens + n)
        starts = starts + accept


def test_static_greedy_continuation_is_the_dynamic_one(model):
    decoder = StaticDecoder(model, StaticShape(slots=3, max_context=64, tokens=1))
    states, starts = prefilled(model, decoder, [3, 9, 22], seed=3)
    last = torch.tensor([[7], [8], [9]])
    dynamic_ids, static_ids = last.clone(), last.clone()
    for _ in range(30):
        dynamic_ids = model(dynamic_ids.reshape(-1), states, [1] * 3).logits.argmax(-1).view(3, 1)
        static_ids = decoder.step(*decoder.plan(static_ids, starts)).argmax(-1)
        assert torch.equal(static_ids, dynamic_ids)
        starts = starts + 1


def test_static_forward_returns_the_dynamic_streams_and_features(model):
    """`forward` with capture layers: the final streams and the captured layers' input streams (what
    DSpark / MTP drafters observe) equal the dynamic call's, per slot and token; `step` is its logits;
    a capture layer outside [0, L] is named."""
    decoder = StaticDecoder(model, StaticShape(slots=3, max_context=64, tokens=3))
    states, starts = prefilled(model, decoder, [4, 0, 17], seed=9)
    g = torch.Generator().manual_seed(10)
    capture = (1, 3, len(model.layers))
    for _ in range(5):
        ids = torch.randint(0, 256, (3, 3), generator=g)
        dynamic = model(ids.reshape(-1), states, [3] * 3, capture_layers=capture)
        static = decoder.forward(*decoder.plan(ids, starts), capture_layers=capture)
        torch.testing.assert_close(static.logits, dynamic.logits.view(3, 3, -1), **TOL)
        torch.testing.assert_close(static.hidden, dynamic.hidden.view(3, 3, *dynamic.hidden.shape[1:]), **TOL)
        assert sorted(static.features) == sorted(capture)
        for i in capture:
            torch.testing.assert_close(static.features[i], dynamic.features[i].view(static.hidden.shape), **TOL)
        starts = starts + 3
    with pytest.raises(ValueError, match=r"capture_layers \[7\]"):
        decoder.forward(*decoder.plan(ids, starts), capture_layers=(7,))


def test_rollback_leaves_no_trace_of_rejected_tokens(model, row_independent_moe):
    """Rounds feed 4 tokens, keep 2 and feed 4 more from there; the rejected positions complete
    CSA (rate 4) and HCA (rate 8) entries and overwrite window rows. Two runs that reject different
    tokens give bit-identical logits afterwards, and both equal (to fp32 tolerance: a different row
    count changes the matmuls' sums) a run that never fed the rejected tokens."""
    check_rollback(StaticDecoder, model)


def test_unused_slot_changes_no_other_slot(model, row_independent_moe):
    """Slot 1 holds no request and is fed junk at position 0 or elsewhere: slots 0 and 2 are unchanged."""
    check_unused_slot(StaticDecoder, model)


def test_static_step_rejects_bad_inputs(model):
    decoder = StaticDecoder(model, StaticShape(slots=2, max_context=32, tokens=4))
    check_bad_inputs(decoder)
    long_state = model.new_state()
    model(torch.zeros(30, dtype=torch.long), [long_state], [30])
    with pytest.raises(ValueError, match="state length 30"):
        decoder.load(0, long_state)
    with pytest.raises(ValueError, match="tokens=0"):
        StaticShape(slots=1, max_context=8, tokens=0)
    with pytest.raises(ValueError, match="slots=2.0"):
        StaticShape(slots=2.0, max_context=8, tokens=1)
    for bad in (4, -1, True, "2"):
        with pytest.raises(ValueError, match=rf"side streams must be an int in \[0, 3\], got {bad!r}"):
            StaticDecoder(model, StaticShape(slots=1, max_context=8, tokens=1), side_streams=bad)
    assert decoder.side.streams == []  # the CPU has no streams: the lanes' work runs inline
    # An unplanned step index (step_index "ref": tensors built on first use by whichever stream asks)
    # keeps the single stream; the planned one takes the lanes asked for.
    assert model.kernels.step_index == "ref"
    assert StaticDecoder(model, StaticShape(slots=1, max_context=8, tokens=1), side_streams=2).side_streams == 0


def test_position_indices_are_built_once_per_step_not_per_layer(model, monkeypatch):
    """`StepIndex`: ring rows and RoPE tables are computed by the first layer that needs them and
    shared: a step's `PositionRing.rows` and `Rope.cos_sin` calls do not grow with the layer count
    (one per distinct ring size / group kind and per table), and the logits are unchanged."""
    from dspark.models.deepseek_v4.rope import Rope
    from dspark.models.deepseek_v4.static_state import PositionRing

    calls = {"rows": 0, "cos_sin": 0}
    for cls, name in ((PositionRing, "rows"), (Rope, "cos_sin")):
        original = getattr(cls, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    decoder = StaticDecoder(model, StaticShape(slots=2, max_context=64, tokens=2))
    ids, starts = decoder.plan([[1, 2], [3, 4]], [0, 5])
    calls.update(rows=0, cos_sin=0)
    decoder.step(ids, starts)
    n_layers = len(model.layers)
    tables = len(decoder.index_tables.ropes)
    assert n_layers >= 4 and calls["rows"] <= 6 < 2 * n_layers  # per layer it was >= 2 (window write + keys)
    assert calls["cos_sin"] <= 2 * tables < n_layers  # token positions + group positions per table


def test_head_weights_early_changes_the_order_not_the_bits(model, monkeypatch):
    check_head_weights_early(StaticDecoder, model, monkeypatch)
