"""The static-shape DSpark drafter (`static_drafter.py`) against the dynamic `DSparkDrafter`.

tiny-v4 (fp32, CPU, window 8) and a random drafter with γ = 5: requests of different lengths (one
empty) run verify rounds that accept a different number of drafts per slot, so the static rings
are written past each slot's next anchor (rejected rows) and wrap many times. The static path
computes the same rows with different row counts (all T rows of every slot), so its keys and logits
agree with the dynamic path's to fp32 tolerance; greedy tokens are identical. The device-side chain
is checked for exactness by χ² on a small vocabulary.
"""

import pytest
import torch
from scipy.stats import chisquare

import dspark
from dspark.draft import DSparkConfig, DSparkDrafter
from dspark.draft.markov_head import MarkovHead
from dspark.draft.static_chain import sample_chain_static
from dspark.draft.static_context import StaticDraftShape
from dspark.draft.static_drafter import StaticDrafter
from dspark.models.deepseek_v4.moe import MoE
from dspark.verify.sts import StsCalibration

GAMMA = 5
LENGTHS = (0, 5, 13, 30)
TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def drafter(tiny):
    config = DSparkConfig.for_target(tiny.config, dspark_markov_rank=32)
    d = DSparkDrafter(tiny, config).init_weights(3)
    return DSparkDrafter(tiny, config, d.model, StsCalibration((0.5, 1.0, 2.0, 4.0, 8.0)))


@pytest.fixture
def row_independent_moe(monkeypatch):
    """The reference MoE groups rows per expert, so a row's sums depend on which rows share its
    experts; for bit-for-bit checks run it one row at a time (same formula)."""
    reference = MoE.forward_ref

    def per_row(self, x, input_ids):
        return torch.cat([reference(self, x[i : i + 1], input_ids[i : i + 1]) for i in range(x.shape[0])])

    monkeypatch.setattr(MoE, "forward_ref", per_row)


class Requests:
    """Target states, dynamic draft states and a static drafter holding the same requests."""

    def __init__(self, tiny, drafter, lengths, seed):
        self.tiny, self.drafter = tiny, drafter
        self.static = StaticDrafter(drafter, StaticDraftShape(slots=len(lengths), tokens=GAMMA + 1))
        self.g = torch.Generator().manual_seed(seed)
        self.states, self.dstates, positions = [], [], []
        for slot, n in enumerate(lengths):
            state, dstate = tiny.new_state(), drafter.new_state()
            if n:
                ids = torch.randint(0, 256, (n,), generator=self.g)
                out = tiny(ids, [state], [n], capture_layers=drafter.capture_layers)
                drafter.observe(dstate, ids, out.hidden, out.features)
            self.states.append(state)
            self.dstates.append(dstate)
            positions.append(self.static.load(slot, dstate))
        self.positions = torch.tensor(positions)
        self.anchors = torch.randint(0, 256, (len(lengths),), generator=self.g)

    def commit(self, tokens, kept):
        """A verify round: the target reads [anchor, drafts] of every slot; slot b commits its first
        kept[b] rows (0: none, e.g. a paused request; else the anchor and kept[b] − 1 drafts).
        Dynamic: observe those rows, truncate. Static: observe all γ + 1 rows at the anchor's
        position; the next anchor position hides the rest."""
        n = len(self.states)
        block = torch.cat((self.anchors[:, None], tokens), dim=1)  # [S, γ + 1]
        out = self.tiny(block.reshape(-1), self.states, [GAMMA + 1] * n, capture_layers=self.drafter.capture_layers)
        feats = {i: f.view(n, GAMMA + 1, *f.shape[1:]) for i, f in out.features.items()}
        hidden = out.hidden.view(n, GAMMA + 1, *out.hidden.shape[1:])
        for b, (state, dstate, k) in enumerate(zip(self.states, self.dstates, kept.tolist())):
            if k:
                self.drafter.observe(dstate, block[b, :k], hidden[b, :k], {i: f[b, :k] for i, f in feats.items()})
            state.truncate(state.length - GAMMA - 1 + k)
        self.static.observe(feats, self.positions)
        self.anchors = torch.randint(0, 256, (n,), generator=self.g)  # the target's extra token
        self.positions = self.positions + kept


def teacher_forced(drafter, dstates, anchors, tokens, temperature):
    """What the dynamic drafter gives for the drafted tokens: q [B, γ, V] and z [B, γ]."""
    out = drafter.block_logits(dstates, anchors.tolist()).out
    head = drafter.model.markov_head
    prev = torch.cat((anchors[:, None], tokens[:, :-1]), dim=1)
    logits = out.base + head.teacher_forced(prev, out.hidden)
    return torch.softmax(logits / temperature[:, None, None], dim=-1), drafter.model.confidence_head(out.hidden_pre,
                                                                                                      head.embed(prev))


def test_static_greedy_propose_equals_dynamic_over_rounds_with_rollback(tiny, drafter):
    """Greedy: tokens identical, confidences (STS-calibrated) and raw logits to fp32 tolerance, over
    rounds committing 0..γ + 1 rows per slot (0: the slot's rows are all rejected junk)."""
    r = Requests(tiny, drafter, LENGTHS, seed=1)
    params = dspark.SamplingParams()
    for round_ in range(10):
        dynamic = drafter.propose(r.dstates, r.anchors.tolist(), params, [torch.Generator()] * len(LENGTHS))
        static = r.static.propose(*r.static.plan(r.anchors, r.positions))
        assert static.probs is None
        assert torch.equal(static.tokens, dynamic.tokens)
        torch.testing.assert_close(static.confidence_logits, dynamic.confidence_logits, **TOL)
        torch.testing.assert_close(static.confidence, dynamic.confidence, **TOL)
        assert r.positions.tolist() == [s.length for s in r.dstates]
        r.commit(dynamic.tokens, torch.randint(0, GAMMA + 2, (len(LENGTHS),), generator=r.g))
    assert min(s.length for s in r.dstates) > 2 * drafter.window  # every ring wrapped


def test_static_confidence_takes_each_rows_calibration_greedy_or_sampled(tiny, drafter):
    """With a greedy calibration (temperatures and biases) beside the sampled one, a mixed bucket's
    greedy rows are calibrated by the greedy one and sampled rows by the sampled one, as the dynamic
    drafter calibrates each kind of request (`calibration_for`); an all-greedy bucket (temperature None)
    reads the greedy one."""
    greedy_cal = StsCalibration((2.0, 0.7, 1.5, 3.0, 0.9), "affine", biases=(0.4, -0.3, 1.1, 0.0, -2.0))
    both = DSparkDrafter(tiny, drafter.config, drafter.model, drafter.calibration, greedy_cal)
    r = Requests(tiny, both, LENGTHS, seed=9)
    temps = torch.tensor([1.0, 0.0, 0.7, 0.0])
    mixed = r.static.propose(*r.static.plan(r.anchors, r.positions, temps))
    z = mixed.confidence_logits
    for row, t in enumerate(temps.tolist()):
        cal = both.calibration_for(t == 0)
        torch.testing.assert_close(mixed.confidence[row], cal.apply(z[row]), **TOL)
    assert not torch.allclose(greedy_cal.apply(z[0]), drafter.calibration.apply(z[0]))  # the two differ
    greedy = r.static.propose(*r.static.plan(r.anchors, r.positions))
    torch.testing.assert_close(greedy.confidence, greedy_cal.apply(greedy.confidence_logits), **TOL)
    dynamic = both.propose(r.dstates, r.anchors.tolist(), dspark.SamplingParams(), [torch.Generator()] * len(LENGTHS))
    torch.testing.assert_close(greedy.confidence, dynamic.confidence, **TOL)


def test_static_sampled_q_is_the_dynamic_distribution_of_the_drawn_tokens(tiny, drafter):
    """Mixed temperatures (slot 1 greedy): q equals the dynamic drafter's distribution teacher-forced on
    the drawn tokens, tokens lie in q's support, greedy rows are the dynamic greedy chain, one-hot."""
    r = Requests(tiny, drafter, LENGTHS, seed=2)
    temps = torch.tensor([1.0, 0.0, 0.7, 1.3])
    for round_ in range(5):
        static = r.static.propose(*r.static.plan(r.anchors, r.positions, temps))
        q, z = teacher_forced(drafter, r.dstates, r.anchors, static.tokens, torch.where(temps > 0, temps, 1.0))
        sampled = [0, 2, 3]
        torch.testing.assert_close(static.probs[sampled], q[sampled], **TOL)
        torch.testing.assert_close(static.confidence_logits, z, **TOL)
        assert bool((static.probs.gather(-1, static.tokens[..., None]) > 0).all())
        greedy = drafter.propose([r.dstates[1]], [int(r.anchors[1])], dspark.SamplingParams(), [torch.Generator()])
        assert torch.equal(static.tokens[1], greedy.tokens[0])
        assert torch.equal(static.probs[1], torch.nn.functional.one_hot(greedy.tokens[0], 258).float())
        r.commit(static.tokens, torch.randint(1, GAMMA + 2, (len(LENGTHS),), generator=r.g))


def test_unused_slot_changes_no_other_slot(tiny, drafter, row_independent_moe):
    """Slot 1 holds no request and is fed junk rows, anchors and positions: the other slots' drafts
    and confidences are bit-identical whatever the junk."""
    outs = []
    for junk in (0, 1):
        r = Requests(tiny, drafter, (11, 0, 19), seed=3)
        g = torch.Generator().manual_seed(4)
        rounds = []
        for _ in range(3):
            anchors, positions = r.anchors.clone(), r.positions.clone()
            anchors[1], positions[1] = (7, 0) if junk == 0 else (200, 55)
            p = r.static.propose(*r.static.plan(anchors, positions))
            rounds.append(torch.cat((p.tokens[[0, 2]].float(), p.confidence[[0, 2]])))
            feats = {i: torch.randn(3, GAMMA + 1, 4, 64, generator=g) for i in drafter.capture_layers}
            if junk:
                for f in feats.values():
                    f[1] = torch.randn(GAMMA + 1, 4, 64) * 10
            r.static.observe(feats, positions)
            r.positions = r.positions + torch.tensor([2, 0, 4])
            r.anchors = torch.randint(0, 256, (3,), generator=g)
        outs.append(torch.stack(rounds))
    assert torch.equal(outs[0], outs[1])


def test_static_chain_samples_q_exactly():
    """χ² on a 6-token vocabulary, one noise key per row (`slot_noise`): x_0 ~ q_0, and x_1 given x_0
    ~ q_1 of those rows; rows with temperature 0 follow the greedy chain with one-hot q."""
    head = MarkovHead(vocab_size=6, rank=3, hidden_size=4)
    with torch.no_grad():
        head.embed.weight.copy_(torch.arange(18.0).view(6, 3) / 10)
        head.head.weight.copy_(torch.arange(18.0).view(6, 3).flip(0) / 7)
    n = 20000
    base = torch.randn(1, 3, 6, generator=torch.Generator().manual_seed(0)).expand(n, -1, -1)
    anchors = torch.full((n,), 2)
    temps = torch.full((n,), 0.8)
    temps[:5] = 0.0
    with torch.no_grad():
        keys, positions = torch.arange(n), torch.full((n,), 7)
        tokens, probs, embeds = sample_chain_static(head, base, torch.zeros(n, 3, 4), anchors, temps, keys, positions)
        greedy, none, _ = sample_chain_static(head, base[:5], torch.zeros(5, 3, 4), anchors[:5], None)
        again, _, _ = sample_chain_static(head, base, torch.zeros(n, 3, 4), anchors, temps, keys, positions)
        moved, _, _ = sample_chain_static(head, base, torch.zeros(n, 3, 4), anchors, temps, keys, positions + 1)
    assert torch.equal(again, tokens) and not torch.equal(moved, tokens)  # a hash of (key, position), nothing else
    assert none is None and torch.equal(tokens[:5], greedy)
    assert torch.equal(probs[:5], torch.nn.functional.one_hot(greedy, 6).float())
    with torch.no_grad():
        q0 = torch.softmax((base[0, 0] + head.head(head.embed(anchors[:1]))[0]) / 0.8, -1)
    torch.testing.assert_close(probs[5:, 0], q0.expand(n - 5, -1))
    counts = torch.bincount(tokens[5:, 0], minlength=6).double()
    assert chisquare(counts.numpy(), (q0.double() / q0.double().sum() * (n - 5)).numpy())[1] > 1e-3
    x0 = int(counts.argmax())
    rows = (tokens[5:, 0] == x0).nonzero().flatten() + 5
    q1 = probs[rows[0], 1]
    torch.testing.assert_close(probs[rows, 1], q1.expand(len(rows), -1))
    counts1 = torch.bincount(tokens[rows, 1], minlength=6).double()
    assert chisquare(counts1.numpy(), (q1.double() / q1.double().sum() * len(rows)).numpy())[1] > 1e-3
    prev = torch.cat((anchors[:, None], tokens[:, :-1]), dim=1)
    torch.testing.assert_close(embeds, head.embed.weight[prev].detach())


def test_slot_noise_is_exponential_keyed_and_batch_free():
    """`slot_noise_ref`: Exp(1) draws (mean and quantiles of 2^20 of them), a pure function of (key, position,
    vocabulary id) -- a row's noise does not depend on the other rows -- and seeds fold to 32-bit keys."""
    from dspark.draft.static_chain import noise_key
    from dspark.kernels.slot_noise import slot_noise_ref as slot_noise

    keys, positions = torch.arange(64), torch.arange(64) * 3 + 11
    noise = slot_noise(keys, positions, 1 << 14)
    assert noise.shape == (64, 1 << 14) and noise.dtype == torch.float32 and bool((noise > 0).all())
    assert abs(noise.mean().item() - 1) < 0.01
    p = torch.tensor([0.5, 0.9, 0.99])
    torch.testing.assert_close(torch.quantile(noise.flatten()[:1 << 20], p), -torch.log1p(-p), atol=0.02, rtol=0)
    assert torch.equal(slot_noise(keys[5:9], positions[5:9], 1 << 14), noise[5:9])  # rows are independent
    assert not torch.equal(slot_noise(keys + 64, positions, 1 << 14), noise)
    assert noise_key(2**64 - 1) == 0 and noise_key(5) == 5 and noise_key((7 << 32) | 7) == 0
    with pytest.raises(ValueError, match="seed must be an int in"):
        noise_key(-1)


def test_static_drafter_rejects_bad_inputs(tiny, drafter):
    static = StaticDrafter(drafter, StaticDraftShape(slots=2, tokens=GAMMA + 1))
    with pytest.raises(ValueError, match=r"anchors\[1\]=258 outside \[0, 258\)"):
        static.plan([0, 258], [0, 0])
    with pytest.raises(ValueError, match=r"positions\[0\]=-3"):
        static.plan([0, 0], [-3, 0])
    with pytest.raises(ValueError, match=r"anchors must be \[b<=2\], got \(3,\)"):
        static.plan([0, 0, 0], [0, 0])
    with pytest.raises(ValueError, match=r"positions must be \[b=1\] like anchors, got \(2,\)"):
        static.plan([0], [0, 0])
    with pytest.raises(ValueError, match=r"temperature\[1\]=-0.5"):
        static.plan([0, 0], [0, 0], [1.0, -0.5])
    with pytest.raises(ValueError, match=r"temperature\[0\]=nan"):
        static.plan([0, 0], [0, 0], [float("nan"), 1.0])
    anchors, positions, _ = static.plan([0, 0], [0, 0])
    with pytest.raises(ValueError, match=r"positions must be a long \[b<=2\].*torch.int32"):
        static.propose(anchors, positions.int())
    with pytest.raises(ValueError, match="keys and positions: required"):
        sample_chain_static(drafter.model.markov_head, torch.zeros(1, 1, 258), torch.zeros(1, 1, 64),
                            anchors[:1], torch.ones(1))
    layer = drafter.capture_layers[0]
    feats = {i: torch.zeros(2, GAMMA + 2, 4, 64) for i in drafter.capture_layers}
    with pytest.raises(ValueError, match=rf"features\[{layer}\] must be \[b<=2, T<=6.*\(2, 7, 4, 64\)"):
        static.observe(feats, positions)
    with pytest.raises(ValueError, match=r"lack target layer\(s\)"):
        static.observe({}, positions)
    with pytest.raises(ValueError, match="slot=2"):
        static.load(2, drafter.new_state())
    odd = drafter.new_state()
    odd.length = 20  # claims 20 rows but holds none
    with pytest.raises(ValueError, match="holds 0 rows at length 20"):
        static.load(0, odd)
    with pytest.raises(ValueError, match="StaticDraftShape.tokens=0"):
        StaticDraftShape(slots=1, tokens=0)
    with pytest.raises(ValueError, match="StaticDraftShape.slots=True"):
        StaticDraftShape(slots=True, tokens=1)


@pytest.mark.parametrize("n", [1, 2, GAMMA])
def test_trimmed_static_propose_is_the_first_slots_of_the_full_block(tiny, drafter, n):
    """A static drafter built for n_draft = n drafts the first n slots of the full static propose:
    the same tokens (greedy, and sampled: each slot's noise is a hash of its key and position), q,
    STS-calibrated confidences and raw logits, n columns each."""
    r = Requests(tiny, drafter, LENGTHS, seed=6)
    trimmed = StaticDrafter(drafter, StaticDraftShape(slots=len(LENGTHS), tokens=GAMMA + 1), n_draft=n)
    assert [trimmed.load(slot, dstate) for slot, dstate in enumerate(r.dstates)] == r.positions.tolist()
    temps = torch.tensor([1.0, 0.0, 0.7, 1.3])
    for temperature in (None, temps):
        args = r.static.plan(r.anchors, r.positions, temperature)
        full, part = r.static.propose(*args), trimmed.propose(*args)
        assert part.tokens.shape == part.confidence.shape == part.confidence_logits.shape == (len(LENGTHS), n)
        assert torch.equal(part.tokens, full.tokens[:, :n])
        torch.testing.assert_close(part.confidence_logits, full.confidence_logits[:, :n], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(part.confidence, full.confidence[:, :n], atol=1e-6, rtol=1e-6)
        if temperature is None:
            assert part.probs is None
        else:
            torch.testing.assert_close(part.probs, full.probs[:, :n], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad", [0, GAMMA + 1, 2.5, False])
def test_static_drafter_rejects_a_bad_n_draft(drafter, bad):
    with pytest.raises(ValueError, match=rf"n_draft must be None or an int in \[1, γ=5\], got {bad!r}"):
        StaticDrafter(drafter, StaticDraftShape(slots=2, tokens=GAMMA + 1), n_draft=bad)


def test_a_narrower_width_per_call_is_the_first_slots_of_the_drafters_block(tiny, drafter):
    """`propose(..., width=w)` of a drafter built for n_draft = 4 equals the first w slots of its
    full propose; widths outside [1, n_draft] are refused by value."""
    r = Requests(tiny, drafter, LENGTHS, seed=7)
    static = StaticDrafter(drafter, StaticDraftShape(slots=len(LENGTHS), tokens=GAMMA + 1), n_draft=4)
    for slot, dstate in enumerate(r.dstates):
        static.load(slot, dstate)
    args = static.plan(r.anchors, r.positions, None)
    full = static.propose(*args)
    for w in (1, 2, 3):
        part = static.propose(*args, width=w)
        assert part.tokens.shape == (len(LENGTHS), w) and torch.equal(part.tokens, full.tokens[:, :w])
        torch.testing.assert_close(part.confidence, full.confidence[:, :w], atol=1e-6, rtol=1e-6)
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match=rf"width must be None or an int in \[1, n_draft=4\], got {bad!r}"):
            static.propose(*args, width=bad)
