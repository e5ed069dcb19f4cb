"""Slot compaction (`move`) and bucketed steps of the static states (V4, V4.1 and the DSpark drafter).

tiny-v4 / tiny-v41 (fp32, CPU). `move(src, dst)` copies every buffer's src rows to dst bit for bit;
the step that then feeds the request at dst equals the step that would have fed it at src to fp32
tolerance only, because on the CPU a row's matmul sums depend on its position in the batch and on
the row count (last bits; not bit-identical even with a per-row MoE). For the same reason a step
over a bucket of the first b slots gives those slots the full step's results to fp32 tolerance; it
leaves slots >= b untouched, bit for bit.
"""

import json
from importlib import resources

import pytest
import torch

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.draft.static_context import StaticDraftShape
from dspark.draft.static_drafter import StaticDrafter
from dspark.models.deepseek_v4.static_state import StaticShape
from dspark.models.deepseek_v4.static_step import StaticDecoder
from dspark.models.deepseek_v41.static_step import StaticDecoderV41

TOL = dict(atol=2e-5, rtol=1e-5)
T = 4


@pytest.fixture(scope="module", params=["v4", "v41"])
def family(request):
    """(model, decoder class) of one family."""
    name = {"v4": "tiny-v4.json", "v41": "tiny-v41.json"}[request.param]
    config = json.loads(resources.files("dspark.configs").joinpath(name).read_text())
    if request.param == "v4":
        return dspark.init_model(config, seed=0), StaticDecoder
    return dspark.init_model(config, seed=0, prefill_mode="exact", cache_qat=False), StaticDecoderV41


def _decoder(family, lengths, slots, seed=1):
    """A decoder of `slots` slots whose slots 0 .. len(lengths) − 1 hold random prompts of `lengths`."""
    model, decoder_class = family
    decoder = decoder_class(model, StaticShape(slots=slots, max_context=96, tokens=T))
    g = torch.Generator().manual_seed(seed)
    starts = []
    for slot, n in enumerate(lengths):
        state = model.new_state()
        model(torch.randint(0, 256, (n,), generator=g), [state], [n])
        starts.append(decoder.load(slot, state))
    return decoder, starts


def _feed(decoder, blocks: dict[int, list[int]], starts: dict[int, int], bucket: int):
    """One step of the first `bucket` slots: slot s gets blocks[s] at starts[s], others token 0 at 0."""
    ids = torch.zeros(bucket, T, dtype=torch.long)
    at = torch.zeros(bucket, dtype=torch.long)
    for slot, block in blocks.items():
        ids[slot] = torch.tensor(block)
        at[slot] = starts[slot]
    return decoder.forward(*decoder.plan(ids, at))


def _snapshot(decoder):
    return [t.clone() for t in decoder.state.slot_tensors()]


def _restore(decoder, snapshot):
    for t, s in zip(decoder.state.slot_tensors(), snapshot):
        t.copy_(s)


@torch.inference_mode()
def test_move_hands_a_slot_its_state(family):
    """Requests in slots 0 and 2 of 3 step twice (the second from a rolled-back start); slot 2 then moves
    to slot 1: every buffer's slot-1 rows equal slot 2's bit for bit, slot 0 is untouched, and the
    next step of the request from slot 1 (now a bucket of 2 slots) equals the step it would have had
    in slot 2; so does slot 0's."""
    decoder, (a, _, c) = _decoder(family, [9, 1, 23], slots=3)
    g = torch.Generator().manual_seed(2)
    block = lambda: torch.randint(0, 256, (T,), generator=g).tolist()  # noqa: E731
    _feed(decoder, {0: block(), 2: block()}, {0: a, 2: c}, 3)
    a, c = a + 2, c + 3  # accepted 2 and 3 rows of the 4
    _feed(decoder, {0: block(), 2: block()}, {0: a, 2: c}, 3)
    a, c = a + 4, c + 1
    before = _snapshot(decoder)
    nxt = {0: block(), 2: block()}
    stay = _feed(decoder, nxt, {0: a, 2: c}, 3)
    stay_logits = stay.logits.clone()
    _restore(decoder, before)
    decoder.move(2, 1)
    for moved, old in zip(decoder.state.slot_tensors(), before):
        assert torch.equal(moved[1], old[2]) and torch.equal(moved[0], old[0]) and torch.equal(moved[2], old[2])
    moved = _feed(decoder, {0: nxt[0], 1: nxt[2]}, {0: a, 1: c}, 2)
    torch.testing.assert_close(moved.logits[1], stay_logits[2], **TOL)
    torch.testing.assert_close(moved.logits[0], stay_logits[0], **TOL)
    with pytest.raises(ValueError, match="src=3 outside"):
        decoder.move(3, 0)


@torch.inference_mode()
def test_bucket_step_equals_the_full_step(family):
    """Verify rounds (random acceptance) of the requests in slots 0, 1 of 4, run on a bucket of 2 slots
    and on all 4 (slots 2, 3 fed idle rows, as the runner feeds free slots): the same logits for
    slots 0, 1 every round; the bucket never touches slots 2, 3 (loaded with other requests: their
    rows stay bit for bit)."""
    lengths = [5, 17, 11, 30]
    small, starts = _decoder(family, lengths, slots=4)
    full, _ = _decoder(family, lengths, slots=4)
    kept = [t[2:].clone() for t in small.state.slot_tensors()]
    g = torch.Generator().manual_seed(3)
    at = {0: starts[0], 1: starts[1]}
    for _ in range(5):
        blocks = {s: torch.randint(0, 256, (T,), generator=g).tolist() for s in range(2)}
        bucketed = _feed(small, blocks, at, 2)
        assert bucketed.logits.shape[0] == 2
        torch.testing.assert_close(bucketed.logits, _feed(full, blocks, at, 4).logits[:2], **TOL)
        for s, n in zip(range(2), torch.randint(1, T + 1, (2,), generator=g).tolist()):
            at[s] += n
    for now, old in zip(small.state.slot_tensors(), kept):
        assert torch.equal(now[2:], old)


@pytest.fixture(scope="module")
def static_drafter():
    """A StaticDrafter of 3 slots on tiny-v4 whose rings hold random keys."""
    config = json.loads(resources.files("dspark.configs").joinpath("tiny-v4.json").read_text())
    model = dspark.init_model(config, seed=0)
    drafter = DSparkDrafter(model, DSparkConfig.for_target(model.config, dspark_markov_rank=16)).init_weights(3)
    static = StaticDrafter(drafter, StaticDraftShape(slots=3, tokens=T))
    g = torch.Generator().manual_seed(5)
    for ring in static.state.rings:
        ring.data.copy_(torch.randn(ring.data.shape, generator=g))
    return static


@torch.inference_mode()
def test_drafter_move_and_bucket(static_drafter):
    """The drafter's slot 2 moved to slot 1 drafts there, in a bucket of 2 slots, what it drafted in
    slot 2 of the full propose (same tokens; confidences to tolerance); an observe over the bucket
    writes slots 0, 1 only."""
    static = static_drafter
    before = [ring.data.clone() for ring in static.state.rings]
    anchors, positions, _ = static.plan([7, 0, 42], [13, 0, 29])
    full = static.propose(anchors, positions)
    static.state.move(2, 1)
    for ring, old in zip(static.state.rings, before):
        assert torch.equal(ring.data[1], old[2]) and torch.equal(ring.data[::2], old[::2])
    anchors, positions, _ = static.plan([7, 42], [13, 29])
    small = static.propose(anchors, positions)
    assert small.tokens.shape[0] == 2 and torch.equal(small.tokens, full.tokens[[0, 2]])
    torch.testing.assert_close(small.confidence, full.confidence[[0, 2]], **TOL)
    target = static.drafter.target.config
    features = {i: torch.randn(2, T, target.hc_mult, target.hidden_size) for i in static.drafter.capture_layers}
    kept = [ring.data[2].clone() for ring in static.state.rings]
    static.observe(features, positions)
    assert all(torch.equal(ring.data[2], old) for ring, old in zip(static.state.rings, kept))
    assert not all(torch.equal(ring.data[1], old[2]) for ring, old in zip(static.state.rings, before))
