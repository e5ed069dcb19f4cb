"""The DSpark drafter against the tiny V4 target: state contract, slot convention, sampling.

(d) `propose` leaves every state bit-identical; `observe` keeps only the last W committed rows; the
state the generate loop builds (prompt chunks, then anchor + accepted drafts per round) equals one
built from scratch over the committed sequence. (e) A drafter whose base logits are forced to the
target's own next tokens reaches τ = γ + 1, and the same oracle shifted by one position collapses
to τ ≈ 1. The training path (teacher-forced blocks) computes exactly the distributions `propose`
samples from.
"""

import dataclasses
import re

import pytest
import torch

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.draft.markov_head import MarkovHead, sample_chain
from dspark.train.anchors import build_blocks
from dspark.train.trainer import draft_forward
from dspark.verify.sts import StsCalibration

GAMMA = 5


@pytest.fixture(scope="module")
def drafter(tiny):
    return DSparkDrafter(tiny, DSparkConfig.for_target(tiny.config, dspark_markov_rank=32)).init_weights(3)


def _rows(model, ids, capture):
    """Target rows of one sequence fed at once: (hidden [L, n_hc, D], features)."""
    out = model(torch.tensor(ids), [model.new_state()], [len(ids)], capture_layers=capture)
    return out.hidden, out.features


def _observe(drafter, state, ids, hidden, features, lo, hi):
    drafter.observe(state, torch.tensor(ids[lo:hi]), hidden[lo:hi], {i: f[lo:hi] for i, f in features.items()})


def _assert_same_state(a, b):
    sa, sb = a.snapshot(), b.snapshot()
    assert sa["length"] == sb["length"]
    for x, y in zip(sa["latents"], sb["latents"]):
        assert torch.equal(x, y)


# -------------------------------------------------------------------------------------------------
# (d) the state contract
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_propose_leaves_the_state_bit_identical(tiny, drafter, temperature):
    ids = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    hidden, features = _rows(tiny, ids, drafter.capture_layers)
    states = [drafter.new_state(), drafter.new_state()]
    _observe(drafter, states[0], ids, hidden, features, 0, 13)
    _observe(drafter, states[1], ids, hidden, features, 0, 4)
    before = [s.snapshot() for s in states]
    params = dspark.SamplingParams(temperature=temperature)
    drafter.propose(states, [7, 9], params, [torch.Generator().manual_seed(0) for _ in states])
    for state, snap in zip(states, before):
        assert state.length == snap["length"]
        assert all(torch.equal(x, y) for x, y in zip(state.snapshot()["latents"], snap["latents"]))


def test_observe_keeps_only_the_last_window_rows_and_chunking_does_not_matter(tiny, drafter):
    window = drafter.window
    ids = torch.randint(0, 256, (3 * window + 2,), generator=torch.Generator().manual_seed(2)).tolist()
    hidden, features = _rows(tiny, ids, drafter.capture_layers)
    whole, chunked = drafter.new_state(), drafter.new_state()
    _observe(drafter, whole, ids, hidden, features, 0, len(ids))
    for lo, hi in [(0, 5), (5, 6), (6, 2 * window + 1), (2 * window + 1, len(ids))]:
        _observe(drafter, chunked, ids, hidden, features, lo, hi)
    assert whole.length == chunked.length == len(ids)
    assert whole.rows == window and whole.start == len(ids) - window
    _assert_same_state(whole, chunked)
    # The kept keys are those of the last W positions, computed at those positions.
    last = slice(len(ids) - window, len(ids))
    main_x = drafter.model.main_x({i: f[last] for i, f in features.items()})
    expected = drafter.model.context_latents(main_x, torch.arange(len(ids) - window, len(ids)))
    assert all(torch.equal(k, e) for k, e in zip(whole.latents, expected))


class _KeepStates:
    """A pass-through drafter that keeps every state it hands out (the engine drops finished ones)."""

    def __init__(self, inner):
        self.inner, self.states = inner, []
        self.block_size, self.capture_layers = inner.block_size, inner.capture_layers

    def new_state(self):
        self.states.append(self.inner.new_state())
        return self.states[-1]

    def observe(self, *args):
        self.inner.observe(*args)

    def propose(self, *args):
        return self.inner.propose(*args)


def test_state_built_over_rounds_equals_state_built_from_committed_rows(tiny, drafter):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 11, 20)]
    keep = _KeepStates(drafter)
    outs = dspark.generate(tiny, prompts, max_new_tokens=15, temperature=1.0, seed=2, draft_tokens=GAMMA,
                           drafter=keep, prefill_chunk=7)
    assert sum(o.stats.rejected_tokens for o in outs) > 0  # rejected rows existed and had to stay out
    for prompt, out, state in zip(prompts, outs, keep.states):
        committed = prompt + out.token_ids[:-1]  # the last token is an anchor nobody has fed yet
        hidden, features = _rows(tiny, committed, drafter.capture_layers)
        fresh = drafter.new_state()
        _observe(drafter, fresh, committed, hidden, features, 0, len(committed))
        assert state.length == fresh.length == len(committed)
        # Same rows, computed by differently chunked target calls: equal up to float rounding.
        for a, b in zip(state.latents, fresh.latents):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


# -------------------------------------------------------------------------------------------------
# (e) the slot convention
# -------------------------------------------------------------------------------------------------


class _Oracle(DSparkDrafter):
    """Base logits forced to the target's own greedy continuation: slot k (position p) gets a large
    logit on reference token p + 1 + shift. Requests are told apart by their prompt."""

    def __init__(self, target, config, references, shift):
        super().__init__(target, config)
        self.init_weights(0)
        self.references, self.shift = references, shift
        self.history = {}

    def observe(self, dstate, token_ids, hidden, features):
        super().observe(dstate, token_ids, hidden, features)
        self.history.setdefault(id(dstate), []).extend(token_ids.tolist())

    def block_logits(self, dstates, anchors, n_draft=None):
        draft = super().block_logits(dstates, anchors, n_draft)
        base = torch.full_like(draft.out.base, -1e4)
        for b, state in enumerate(dstates):
            seen = self.history[id(state)]
            ref = next(r for p, r in self.references if seen[:len(p)] == p)
            for k, pos in enumerate(draft.positions[b, :base.shape[1]].tolist()):
                base[b, k, ref[min(pos + 1 + self.shift, len(ref) - 1)]] = 1e4
        return dataclasses.replace(draft, out=dataclasses.replace(draft.out, base=base))


@pytest.mark.parametrize("shift", [0, 1, -1])
def test_forced_oracle_reaches_gamma_plus_one_and_a_shift_breaks_it(tiny, shift):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(8)]
    new = 1 + 3 * (GAMMA + 1)  # the first token from prefill, then exactly three full rounds
    plain = [o.token_ids for o in dspark.generate(tiny, prompts, max_new_tokens=new)]
    references = [(p, p + o) for p, o in zip(prompts, plain)]
    oracle = _Oracle(tiny, DSparkConfig.for_target(tiny.config, dspark_markov_rank=8), references, shift)
    outs = dspark.generate(tiny, prompts, max_new_tokens=new, draft_tokens=GAMMA, drafter=oracle)
    assert [o.token_ids for o in outs] == plain
    full = [o for o in outs if o.finish_reason == "length"]
    assert len(full) >= 4
    tau = sum(o.stats.new_tokens - 1 for o in full) / sum(o.stats.rounds for o in full)
    print(f"oracle shift {shift}: tau {tau:.2f}")
    if shift == 0:
        assert tau == GAMMA + 1
    else:
        assert tau < 1.5


# -------------------------------------------------------------------------------------------------
# Training path == inference path
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("anchor", [0, 1, 6, 17, 25])
def test_teacher_forced_block_equals_what_propose_samples_from(tiny, drafter, anchor):
    ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(6))
    hidden, features = _rows(tiny, ids.tolist(), drafter.capture_layers)
    state = drafter.new_state()
    if anchor:
        _observe(drafter, state, ids.tolist(), hidden, features, 0, anchor)
    prop = drafter.propose([state], [int(ids[anchor])], dspark.SamplingParams(temperature=1.0),
                           [torch.Generator().manual_seed(1)])
    noise = drafter.config.dspark_noise_token_id
    blocks = build_blocks(ids, torch.ones_like(ids), torch.tensor([anchor]), GAMMA, noise)
    # Teacher-force the previous tokens the sampler actually drew: [anchor, x_0, .., x_{γ-2}].
    prev = torch.cat((ids[anchor:anchor + 1], prop.tokens[0, :-1]))[None]
    with torch.no_grad():
        logits, z = draft_forward(drafter, features, dataclasses.replace(blocks, prev=prev))
    torch.testing.assert_close(logits.softmax(-1), prop.probs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(z, prop.confidence_logits, atol=1e-4, rtol=1e-4)


# -------------------------------------------------------------------------------------------------
# Sampling, confidences, heads
# -------------------------------------------------------------------------------------------------


def test_markov_bias_is_added_before_temperature():
    head = MarkovHead(vocab_size=6, rank=3, hidden_size=4)
    with torch.no_grad():
        head.embed.weight.copy_(torch.arange(18.0).view(6, 3) / 10)
        head.head.weight.copy_(torch.arange(18.0).view(6, 3).flip(0) / 7)
    base = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([1, 4])
    params = dspark.SamplingParams(temperature=0.5)
    tokens, probs, embeds = sample_chain(head, base, torch.zeros(2, 3, 4), anchors, params,
                                         [torch.Generator().manual_seed(i) for i in range(2)])
    prev = torch.cat((anchors[:, None], tokens[:, :-1]), dim=1)
    bias = head.embed.weight[prev] @ head.head.weight.T  # B_k = W2 · W1[x_{k-1}]
    torch.testing.assert_close(probs, torch.softmax((base + bias) / 0.5, dim=-1))
    torch.testing.assert_close(embeds, head.embed.weight[prev])
    greedy, none, _ = sample_chain(head, base, torch.zeros(2, 3, 4), anchors, dspark.SamplingParams(), [])
    assert none is None
    prev = anchors
    for k in range(3):  # greedy: argmax of U_k + B(x_{k-1}) along the chain
        prev = (base[:, k] + head.head(head.embed(prev))).argmax(-1)
        assert torch.equal(greedy[:, k], prev)


def test_proposal_shapes_confidences_and_sts(tiny, drafter):
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(7)).tolist()
    hidden, features = _rows(tiny, ids, drafter.capture_layers)
    state = drafter.new_state()
    _observe(drafter, state, ids, hidden, features, 0, 9)
    prop = drafter.propose([state], [3], dspark.SamplingParams(temperature=0.8), [torch.Generator().manual_seed(0)])
    assert prop.tokens.shape == (1, GAMMA) and prop.probs.shape == (1, GAMMA, 258)
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(1, GAMMA))
    assert bool((prop.probs.gather(-1, prop.tokens[..., None]) > 0).all())
    torch.testing.assert_close(prop.confidence, torch.sigmoid(prop.confidence_logits))
    temps = (0.5, 1.0, 2.0, 4.0, 8.0)
    calibrated = DSparkDrafter(tiny, drafter.config, drafter.model, StsCalibration(temps))
    again = calibrated.propose([state], [3], dspark.SamplingParams(temperature=0.8), [torch.Generator().manual_seed(0)])
    assert torch.equal(again.tokens, prop.tokens)
    torch.testing.assert_close(again.confidence, torch.sigmoid(prop.confidence_logits / torch.tensor(temps)))
    with pytest.raises(ValueError, match="γ=3"):
        calibrated.set_calibration(StsCalibration((1.0, 1.0, 1.0)))
    # a greedy calibration serves greedy requests only; sampled ones keep `calibration`
    biases = (1.0, -1.0, 0.5, 0.0, 2.0)
    calibrated.set_calibration(StsCalibration((1.0,) * GAMMA, "affine", biases=biases), greedy=True)
    greedy = calibrated.propose([state], [3], dspark.SamplingParams(), [torch.Generator()])
    torch.testing.assert_close(greedy.confidence, torch.sigmoid(greedy.confidence_logits + torch.tensor(biases)))
    sampled = calibrated.propose([state], [3], dspark.SamplingParams(temperature=0.8), [torch.Generator().manual_seed(0)])
    torch.testing.assert_close(sampled.confidence, again.confidence)
    with pytest.raises(ValueError, match="γ=3"):
        calibrated.set_calibration(StsCalibration((1.0, 1.0, 1.0)), greedy=True)


def test_rnn_head_and_confidence_without_markov(tiny):
    config = DSparkConfig.for_target(tiny.config, dspark_markov_rank=8, dspark_markov_head_type="rnn",
                                     dspark_confidence_with_markov=False, dspark_block_size=3,
                                     dspark_n_routed_experts=4, dspark_n_activated_experts=1)
    d = DSparkDrafter(tiny, config).init_weights(1)
    keys = d.model.state_dict()
    assert keys["mtp.2.markov_head.cell.weight"].shape == (3 * 8, 2 * 8 + 64)
    assert keys["mtp.2.confidence_head.proj.weight"].shape == (1, 64)
    assert keys["mtp.1.ffn.gate.weight"].shape == (4, 64)
    ids = list(range(10, 22))
    hidden, features = _rows(tiny, ids, d.capture_layers)
    state = d.new_state()
    _observe(d, state, ids, hidden, features, 0, len(ids))
    prop = d.propose([state], [5], dspark.SamplingParams(temperature=1.0), [torch.Generator().manual_seed(0)])
    blocks = build_blocks(torch.tensor(ids + [5]), torch.ones(13, dtype=torch.long), torch.tensor([12]), 3,
                          config.dspark_noise_token_id)
    prev = torch.cat((torch.tensor([5]), prop.tokens[0, :-1]))[None]
    hidden, features = _rows(tiny, ids + [5], d.capture_layers)
    with torch.no_grad():
        logits, _ = draft_forward(d, features, dataclasses.replace(blocks, prev=prev))
    torch.testing.assert_close(logits.softmax(-1), prop.probs, atol=1e-5, rtol=1e-4)


# -------------------------------------------------------------------------------------------------
# A block drafted only as far as it is verified (n_draft)
# -------------------------------------------------------------------------------------------------


def _rnn_drafter(tiny):
    config = DSparkConfig.for_target(tiny.config, dspark_markov_rank=8, dspark_markov_head_type="rnn",
                                     dspark_confidence_with_markov=False)
    return DSparkDrafter(tiny, config).init_weights(2)


@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_trimmed_propose_is_the_first_slots_of_the_full_block(tiny, drafter, head, temperature):
    """propose(n_draft=n) drafts the first n slots of the full block: the same tokens (sampled ones too,
    from generators of the same seeds: the chain draws slot by slot), q, STS-calibrated confidences and
    raw logits, n columns each; the backbone output it drafts from holds n slots (the LM head ran N·n
    rows)."""
    base = drafter if head == "markov" else _rnn_drafter(tiny)
    d = DSparkDrafter(tiny, base.config, base.model, StsCalibration((0.5, 1.0, 2.0, 4.0, 8.0)))
    ids = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(8)).tolist()
    hidden, features = _rows(tiny, ids, d.capture_layers)
    states = [d.new_state() for _ in range(3)]
    _observe(d, states[0], ids, hidden, features, 0, 13)
    _observe(d, states[1], ids, hidden, features, 0, 4)  # states[2] holds nothing yet
    anchors, params = [7, 9, 200], dspark.SamplingParams(temperature=temperature)

    def generators():
        return [torch.Generator().manual_seed(s) for s in (0, 1, 2)]

    full = d.propose(states, anchors, params, generators())
    assert full.tokens.shape == (3, GAMMA)
    for n in range(1, GAMMA + 1):
        part = d.propose(states, anchors, params, generators(), n_draft=n)
        assert part.tokens.shape == part.confidence.shape == part.confidence_logits.shape == (3, n)
        assert torch.equal(part.tokens, full.tokens[:, :n])
        torch.testing.assert_close(part.confidence_logits, full.confidence_logits[:, :n], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(part.confidence, full.confidence[:, :n], atol=1e-6, rtol=1e-6)
        if temperature:
            torch.testing.assert_close(part.probs, full.probs[:, :n], atol=1e-6, rtol=1e-6)
        else:
            assert part.probs is None
        out = d.block_logits(states, anchors, n).out
        assert out.base.shape == (3, n, 258) and out.hidden.shape[:2] == out.hidden_pre.shape[:2] == (3, n)


@pytest.mark.parametrize("bad", [0, GAMMA + 1, -1, 2.0, True, "3"])
def test_bad_n_draft_is_refused(tiny, drafter, bad):
    state = drafter.new_state()
    message = rf"n_draft must be None or an int in \[1, γ=5\], got {re.escape(repr(bad))}"
    with pytest.raises(ValueError, match=message):
        drafter.propose([state], [3], dspark.SamplingParams(), [torch.Generator()], n_draft=bad)
    with pytest.raises(ValueError, match=message):
        drafter.block_logits([state], [3], bad)
