"""MTP-1 drafting from the target's `mtp.0` block: committed pairs only, side-effect-free proposals."""

import json
from importlib import resources

import pytest
import torch

import dspark
from dspark.draft import MtpDrafter


@pytest.fixture(scope="module")
def tiny():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    return dspark.init_model(config, seed=0)


def _target_rows(model, ids):
    out = model(torch.tensor(ids), [model.new_state()], [len(ids)])
    return out.hidden, out.logits


def test_state_holds_exactly_the_committed_pairs(tiny):
    ids = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(0)).tolist()
    hidden, _ = _target_rows(tiny, ids)
    drafter = MtpDrafter(tiny)
    state = drafter.new_state()
    for lo, hi in [(0, 5), (5, 6), (6, 9), (9, 14)]:  # a prompt chunk, then rounds of 1 and 3 rows
        drafter.observe(state, torch.tensor(ids[lo:hi]), hidden[lo:hi])
    # Reference: the 13 pairs (X_t, tok_{t+1}), t = 0..12, fed in one call.
    reference = tiny.new_mtp_state()
    tiny.forward_mtp(hidden[:-1], torch.tensor(ids[1:]), [reference], [13])
    assert state.state.length == reference.length == 13
    ours, theirs = state.state.snapshot(live_only=True), reference.snapshot(live_only=True)
    assert ours.keys() == theirs.keys()
    for key in ours:  # what the next call reads; computed in differently chunked calls, so rounding only
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5)
    assert torch.equal(state.pending, hidden[-1])


def test_proposal_is_the_mtp_prediction_and_leaves_the_state_unchanged(tiny):
    ids = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    hidden, _ = _target_rows(tiny, ids)
    drafter = MtpDrafter(tiny, block_size=3)
    state = drafter.new_state()
    drafter.observe(state, torch.tensor(ids), hidden)
    before = state.state.snapshot()
    prop = drafter.propose([state], [42], dspark.SamplingParams(), [torch.Generator()])
    after = state.state.snapshot()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) if torch.is_tensor(before[k]) else before[k] == after[k]
               for k in before)
    assert prop.probs is None and prop.tokens.shape == (1, 3)
    # x_0 is the MTP block's argmax for the pair (X_9, anchor) at position 9, after the committed pairs.
    reference = tiny.new_mtp_state()
    tiny.forward_mtp(hidden[:-1], torch.tensor(ids[1:]), [reference], [9])
    out = tiny.forward_mtp(hidden[-1:], torch.tensor([42]), [reference], [1])
    assert int(prop.tokens[0, 0]) == int(out.logits[0].argmax())
    # x_1 chains on the block's own output streams and x_0.
    out = tiny.forward_mtp(out.hidden, prop.tokens[0, :1], [reference], [1])
    assert int(prop.tokens[0, 1]) == int(out.logits[0].argmax())


def test_sampled_proposal_reports_its_distribution(tiny):
    ids = list(range(30, 38))
    hidden, _ = _target_rows(tiny, ids)
    drafter = MtpDrafter(tiny, block_size=2, confidence=0.6)
    state = drafter.new_state()
    drafter.observe(state, torch.tensor(ids), hidden)
    prop = drafter.propose([state], [7], dspark.SamplingParams(temperature=0.7), [torch.Generator().manual_seed(3)])
    assert prop.probs.shape == (1, 2, 258)
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(1, 2))
    assert bool((prop.probs.gather(-1, prop.tokens[..., None]) > 0).all())
    assert torch.equal(prop.confidence, torch.full((1, 2), 0.6))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(block_size=0), "block_size"), (dict(depth=1), "depth"), (dict(confidence=0.0), "confidence"),
])
def test_bad_arguments_are_named(tiny, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        MtpDrafter(tiny, **kwargs)


def test_target_without_mtp_block_is_refused():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    bare = dspark.init_model({**config, "num_nextn_predict_layers": 0})
    with pytest.raises(ValueError, match="no MTP block"):
        MtpDrafter(bare)
