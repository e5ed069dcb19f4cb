"""`StaticMtpDrafter`: observe / propose of the MTP block over static slots equal `MtpDrafter`'s dynamic
path on the same committed rows (tiny-v4, fp32, CPU, eager). The static latents agree with the
dynamic ones to fp32 tolerance, so greedy drafts are compared exactly and q to a tolerance."""

import json
from importlib import resources

import pytest
import torch

import dspark
from dspark.draft import MtpDrafter
from dspark.draft.static_mtp import StaticMtpDrafter
from dspark.models.deepseek_v4.static_state import StaticShape
from dspark.sampling import SamplingParams

SLOTS, CONTEXT, T = 4, 64, 3  # T: a verify step of the anchor + 2 drafts


@pytest.fixture(scope="module")
def tiny():
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    return dspark.init_model(config, seed=0)


class Request:
    """One sequence: its target rows (all at once: the verify steps' rows equal them), the dynamic
    MTP state fed with the committed rows, and its static slot."""

    def __init__(self, model, drafter, slot, n_prompt, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (40,), generator=g)
        self.hidden = model(self.ids, [model.new_state()], [40]).hidden  # [40, n_hc, D]
        self.dstate, self.slot, self.length = drafter.new_state(), slot, n_prompt
        drafter.observe(self.dstate, self.ids[:n_prompt], self.hidden[:n_prompt])


def _step_inputs(requests, width):
    """The bucket's verify-step rows: every request's next `width` rows at its length (free slots: 0)."""
    b = max(r.slot for r in requests) + 1
    hidden = torch.zeros(b, width, *requests[0].hidden.shape[1:])
    ids, starts = torch.zeros(b, width, dtype=torch.long), torch.zeros(b, dtype=torch.long)
    for r in requests:
        hidden[r.slot], ids[r.slot] = r.hidden[r.length:r.length + width], r.ids[r.length:r.length + width]
        starts[r.slot] = r.length
    return hidden, starts, ids


def _propose(static, requests, temps=None):
    b = max(r.slot for r in requests) + 1
    anchors, positions, t = [0] * b, [0] * b, [0.0] * b
    for r, temp in zip(requests, temps or [0.0] * len(requests)):
        anchors[r.slot], positions[r.slot], t[r.slot] = int(r.ids[r.length]), r.length, temp
    return static.propose(*static.plan(anchors, positions, t if temps else None))


@pytest.mark.parametrize("block_size", [1, 2])
def test_static_rounds_draft_what_the_dynamic_drafter_drafts(tiny, block_size):
    """Two requests in slots 2 and 0 of a bucket of 3 (slot 1 free), loaded after prompts of 7 and 12
    rows, then rounds that verify T rows each and accept 0, 2 or 1 of them (the rejected rows are
    observed too and hidden by the next anchor), and a move of slot 2 to slot 1: every greedy
    proposal equals the dynamic `propose` on the dynamic state fed only the committed rows, and so
    does the first link's q of a sampled one (sampled proposals leave the state as greedy ones do)."""
    drafter = MtpDrafter(tiny, block_size=block_size)
    static = StaticMtpDrafter(drafter, StaticShape(SLOTS, CONTEXT, T))
    requests = [Request(tiny, drafter, 2, 7, seed=1), Request(tiny, drafter, 0, 12, seed=2)]
    for r in requests:
        assert static.load(r.slot, r.dstate) == r.length

    def check():
        proposal = _propose(static, requests)
        assert proposal.probs is None and proposal.confidence_logits is None
        for r in requests:
            dynamic = drafter.propose([r.dstate], [int(r.ids[r.length])], SamplingParams(), [torch.Generator()])
            assert proposal.tokens[r.slot].tolist() == dynamic.tokens[0].tolist()
            assert torch.equal(proposal.confidence[r.slot], dynamic.confidence[0])
        # q of the first link at T = 1 (later links follow a sampled token): the block's logits themselves
        sampled = _propose(static, requests, [1.0, 1.0])
        for r in requests:
            dynamic = drafter.propose([r.dstate], [int(r.ids[r.length])], SamplingParams(temperature=1.0),
                                      [torch.Generator().manual_seed(0)])
            torch.testing.assert_close(sampled.probs[r.slot, 0], dynamic.probs[0, 0], atol=1e-5, rtol=1e-4)

    check()
    for round_, accepted in enumerate([(0, 2), (2, 1), (1, 0)]):
        static.observe(*_step_inputs(requests, T))
        for r, a in zip(requests, accepted):
            drafter.observe(r.dstate, r.ids[r.length:r.length + a + 1], r.hidden[r.length:r.length + a + 1])
            r.length += a + 1
        if round_ == 1:  # the slot table's compaction: the last held slot moves into a freed one
            static.move(2, 1)
            requests[0].slot = 1
        check()


def test_sampled_rows_report_the_dynamic_distribution(tiny):
    """A mixed bucket (slot 0 greedy, slot 1 at T = 0.7): the greedy row's draft is the dynamic argmax
    with a one-hot q; the sampled row's q is the dynamic drafter's q (softmax of the block's logits at
    T) and its token is drawn from it, with the noise of the slot's key (a request's drafts depend on
    its key and positions, not on its slot)."""
    drafter = MtpDrafter(tiny)
    static = StaticMtpDrafter(drafter, StaticShape(2, CONTEXT, 2))
    requests = [Request(tiny, drafter, 0, 9, seed=3), Request(tiny, drafter, 1, 5, seed=4)]
    for r in requests:
        static.load(r.slot, r.dstate, 40 + r.slot)
    proposal = _propose(static, requests, [0.0, 0.7])
    greedy_row, sampled = requests
    dynamic = drafter.propose([greedy_row.dstate], [int(greedy_row.ids[9])], SamplingParams(), [torch.Generator()])
    assert proposal.tokens[0].tolist() == dynamic.tokens[0].tolist()
    assert proposal.probs[0, 0].max() == 1 and proposal.probs[0, 0, int(dynamic.tokens[0, 0])] == 1
    dynamic = drafter.propose([sampled.dstate], [int(sampled.ids[5])], SamplingParams(temperature=0.7),
                              [torch.Generator().manual_seed(0)])
    torch.testing.assert_close(proposal.probs[1], dynamic.probs[0], atol=1e-5, rtol=1e-4)
    assert float(proposal.probs[1, 0, int(proposal.tokens[1, 0])]) > 0
    static.move(1, 0)  # the sampled request alone in slot 0, its key with it: the same draft
    sampled.slot = 0
    alone = _propose(static, [sampled], [0.7])
    assert torch.equal(alone.tokens[0], proposal.tokens[1])


def test_bad_inputs_are_named(tiny):
    drafter = MtpDrafter(tiny)
    static = StaticMtpDrafter(drafter, StaticShape(2, CONTEXT, 2))
    with pytest.raises(ValueError, match="observed at least one row"):
        static.load(0, drafter.new_state())
    request = Request(tiny, drafter, 0, 5, seed=5)
    with pytest.raises(ValueError, match="slot=2"):
        static.load(2, request.dstate)
    with pytest.raises(ValueError, match="anchors"):
        static.plan([0, 0, 0], [1, 1, 1])
    with pytest.raises(ValueError, match=r"temperature\[1\]"):
        static.plan([0, 0], [1, 1], [0.0, -1.0])
    with pytest.raises(ValueError, match="observe"):
        static.observe(torch.zeros(2, 3, 4, 64), torch.zeros(2, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size 4 exceeds"):
        StaticMtpDrafter(MtpDrafter(tiny, block_size=4), StaticShape(2, CONTEXT, 2))
    with pytest.raises(ValueError, match="MtpDrafter"):
        StaticMtpDrafter(object(), StaticShape(2, CONTEXT, 2))
