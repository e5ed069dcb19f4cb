import pytest
import torch

from dspark.draft.ngram import NgramDrafter
from dspark.sampling import SamplingParams


def _propose(drafter, history, anchor):
    state = drafter.new_state()
    drafter.observe(state, torch.tensor(history))
    return drafter.propose([state], [anchor], SamplingParams(), [torch.Generator()])


def test_longest_latest_suffix_match_is_proposed():
    d = NgramDrafter(block_size=3, max_ngram=3)
    # suffix [7, 8] + anchor 9 occurred twice; the latest occurrence is followed by 4, 5, 6.
    out = _propose(d, [7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0, 7, 8], 9)
    assert out.tokens.tolist() == [[4, 5, 6]]
    assert out.probs is None
    assert out.confidence.tolist() == [[pytest.approx(0.7)] * 3]


def test_miss_pads_with_anchor_and_low_confidence():
    d = NgramDrafter(block_size=4)
    out = _propose(d, [1, 2, 3], 9)
    assert out.tokens.tolist() == [[9, 9, 9, 9]]
    assert out.confidence.tolist() == [[pytest.approx(0.05)] * 4]


def test_short_match_is_padded():
    d = NgramDrafter(block_size=4, max_ngram=2)
    out = _propose(d, [5, 6, 5], 6)  # suffix [5, 6] matched at the start, followed by 5 then the end
    assert out.tokens.tolist()[0][:2] == [5, 6]
    assert out.confidence[0, 2:].tolist() == [pytest.approx(0.05)] * 2


def test_propose_leaves_state_unchanged():
    d = NgramDrafter()
    state = d.new_state()
    d.observe(state, torch.tensor([1, 2, 1, 2]))
    before = list(state.tokens)
    d.propose([state], [1], SamplingParams(), [torch.Generator()])
    assert state.tokens == before


@pytest.mark.parametrize("kwargs", [dict(block_size=0), dict(min_ngram=0), dict(min_ngram=3, max_ngram=2)])
def test_bad_config_is_named(kwargs):
    with pytest.raises(ValueError):
        NgramDrafter(**kwargs)
