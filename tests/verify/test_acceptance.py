"""dspark.verify.acceptance: greedy cases, rejection-sampling edge cases, batching, laws of A."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.sampling import SamplingParams, probs_from_logits, sample
from dspark.verify.acceptance import (pad_ragged, verify_chain, verify_chain_batch, verify_greedy,
                                      verify_greedy_batch, verify_sample, verify_sample_batch)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _one_hot_rows(ids, vocab):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


# ---------------------------------------------------------------------------------------------
# Greedy


def test_greedy_all_accepted_gives_the_bonus_argmax():
    n, nxt = verify_greedy(torch.tensor([3, 1, 4]), torch.tensor([3, 1, 4, 2]))
    assert (int(n), int(nxt)) == (3, 2) and n.dtype == torch.int64 and n.dim() == 0


@pytest.mark.parametrize("drafts, expected", [
    ([5, 1, 4], (0, 3)),  # first draft wrong: correction = argmax of row 0
    ([3, 0, 4], (1, 1)),  # second wrong: argmax of row 1
    ([3, 1, 0], (2, 4)),  # third wrong
    ([3, 0, 0], (1, 1)),  # later matches after a mismatch do not count
])
def test_greedy_first_rejection_takes_the_target_argmax(drafts, expected):
    n, nxt = verify_greedy(torch.tensor(drafts), torch.tensor([3, 1, 4, 2]))
    assert (int(n), int(nxt)) == expected


def test_greedy_accepts_logits_and_empty_blocks():
    logits = torch.full((3, 6), -1.0)
    logits[0, 2] = logits[1, 5] = logits[2, 0] = 1.0
    logits[1, 4] = 1.0  # tie in row 1: argmax is the lower id 4, so draft 5 is rejected
    n, nxt = verify_greedy(torch.tensor([2, 5]), logits)
    assert (int(n), int(nxt)) == (1, 4)
    n, nxt = verify_greedy(torch.zeros(0, dtype=torch.long), logits[:1])
    assert (int(n), int(nxt)) == (0, 2)


def test_greedy_batch_ragged_lengths_ignore_padding():
    drafts = torch.tensor([[3, 1, 4], [7, 7, -1], [2, -1, -1], [0, 0, 0]])
    target = torch.tensor([[3, 1, 4, 2], [7, 8, 9, 9], [2, 6, 0, 0], [5, 5, 5, 5]])
    n, nxt = verify_greedy_batch(drafts, target, [3, 2, 1, 0])
    assert n.tolist() == [3, 1, 1, 0]
    assert nxt.tolist() == [2, 8, 6, 5]


def test_sampled_verifier_with_one_hot_target_is_greedy():
    # At temperature 0 the target is one-hot, and rejection sampling reduces to greedy matching
    # whatever the drafter's q (the residual is the one-hot minus q, all on the argmax).
    g = _gen(0)
    for _ in range(50):
        logits = torch.randn(4, 5, generator=g)
        q = torch.softmax(torch.randn(3, 5, generator=g), -1)
        drafts = sample(q, g)
        drafts[0] = logits[0].argmax()  # make some leading runs non-trivial
        p = probs_from_logits(logits, SamplingParams(0.0))
        got = verify_sample(drafts, q, p, g)
        want = verify_greedy(drafts, logits)
        assert [int(x) for x in got] == [int(x) for x in want]


# ---------------------------------------------------------------------------------------------
# Sampled verification: edge cases


def test_identical_distributions_accept_everything():
    g = _gen(1)
    p = torch.softmax(torch.randn(4, 6, generator=g), -1)  # rows 0..2 judge drafts, row 3 = bonus
    rows = 2000
    drafts = sample(p[:3].expand(rows, -1, -1), g)  # [rows, 3]
    n, nxt = verify_sample_batch(drafts, p[:3].expand(rows, -1, -1), p.expand(rows, -1, -1), [3] * rows, g)
    assert (n == 3).all()
    counts = torch.bincount(nxt, minlength=6).double().numpy()
    assert chisquare(counts, rows * p[3].double().numpy())[1] > 1e-3  # bonus from row 3


def test_disjoint_support_always_rejects_and_resamples_the_target():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.0, 0.0, 0.3, 0.7]])
    rows = 4000
    g = _gen(2)
    drafts = sample(q.expand(rows, -1), g)[:, None]
    n, nxt = verify_sample_batch(drafts, q.expand(rows, -1, -1), p.expand(rows, -1, -1), [1] * rows, g)
    assert (n == 0).all()
    assert chisquare(torch.bincount(nxt, minlength=4)[:2].double().numpy(), [rows / 2] * 2)[1] > 1e-3
    assert (nxt < 2).all()  # residual = p here, which has no mass on tokens 2, 3


def test_zero_draft_probability_and_zero_target_probability():
    p = torch.tensor([[0.0, 0.6, 0.4], [0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.5, 0.0, 0.5], [0.2, 0.3, 0.5]])
    g = _gen(3)
    # q(x) = 0 while p(x) > 0: the ratio is +inf, so the draft is always accepted.
    n, _ = verify_sample_batch(torch.tensor([[1, 0]]).expand(500, -1), q.expand(500, -1, -1),
                               p.expand(500, -1, -1), [1] * 500, g)
    assert (n == 1).all()
    # p(x) = 0: never accepted, whatever q says (x = 0 is outside the target's support).
    n, nxt = verify_sample_batch(torch.tensor([[0, 0]]).expand(500, -1), q.expand(500, -1, -1),
                                 p.expand(500, -1, -1), [2] * 500, g)
    assert (n == 0).all() and (nxt != 0).all()


def test_empty_residual_falls_back_to_the_target():
    # q = 2p is not a distribution, so acceptance has probability 1/2 while max(0, p - q) = 0 on
    # every token; the fallback must still emit target-supported tokens with the target's odds.
    p = torch.tensor([[0.0, 0.25, 0.75], [0.0, 0.25, 0.75]])
    q = 2 * p[:1]
    rows = 20_000
    g = _gen(4)
    drafts = torch.full((rows, 1), 2)
    n, nxt = verify_sample_batch(drafts, q.expand(rows, -1, -1), p.expand(rows, -1, -1), [1] * rows, g)
    rejected = nxt[n == 0]
    assert 0.45 < rejected.numel() / rows < 0.55
    assert (rejected != 0).all()
    counts = torch.bincount(rejected, minlength=3)[1:].double().numpy()
    assert chisquare(counts, counts.sum() * np.array([0.25, 0.75]))[1] > 1e-3


def test_point_mass_drafter_matches_explicit_one_hot_probs():
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(16, 4, 7, generator=g), -1)
    drafts = torch.randint(0, 7, (16, 3), generator=g)
    one_hot = torch.nn.functional.one_hot(drafts, 7).float()
    lengths = [3, 2, 1, 0] * 4
    a = verify_sample_batch(drafts, None, p, lengths, _gen(11))
    b = verify_sample_batch(drafts, one_hot, p, lengths, _gen(11))
    c = verify_sample_batch(drafts.int(), None, p, torch.tensor(lengths), _gen(11))  # int32 ids, tensor lengths
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    assert all((a[1][r] != drafts[r, a[0][r]]) for r in range(16) if a[0][r] < lengths[r])


def test_batch_with_per_request_generators_equals_single_calls():
    g = _gen(6)
    rows, width, vocab = 5, 3, 8
    p = torch.softmax(torch.randn(rows, width + 1, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(rows, width, vocab, generator=g), -1)
    drafts = sample(q, g)
    lengths = [3, 0, 2, 1, 3]
    n, nxt = verify_sample_batch(drafts, q, p, lengths, [_gen(50 + r) for r in range(rows)])
    for r, k in enumerate(lengths):
        n1, nxt1 = verify_sample(drafts[r, :k], q[r, :k], p[r, :k + 1], _gen(50 + r))
        assert (int(n[r]), int(nxt[r])) == (int(n1), int(nxt1))
    again = verify_sample_batch(drafts, q, p, lengths, [_gen(50 + r) for r in range(rows)])
    assert torch.equal(again[0], n) and torch.equal(again[1], nxt)


def test_verify_chain_dispatches_on_temperature():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    n, nxt = verify_chain(torch.tensor([1, 2]), None, logits, SamplingParams(0.0))
    assert (int(n), int(nxt)) == (1, 0)
    n, nxt = verify_chain(torch.tensor([1, 2]), None, logits, SamplingParams(1.0, top_k=1), _gen(0))
    assert (int(n), int(nxt)) == (1, 0)  # top_k = 1 makes every target row one-hot
    with pytest.raises(ValueError, match="generator"):
        verify_chain(torch.tensor([1, 2]), None, logits, SamplingParams(1.0))
    nb, nxtb = verify_chain_batch(torch.tensor([[1, 2], [1, 0]]), None, logits.expand(2, -1, -1), [2, 1],
                                  SamplingParams(0.0))
    assert nb.tolist() == [1, 1] and nxtb.tolist() == [0, 0]


def test_pad_ragged_scatters_flat_rows():
    flat = torch.arange(12.0).view(6, 2)  # requests with 3, 1, 2 rows
    out = pad_ragged(flat, [3, 1, 2], width=3, fill=-1)
    assert out.shape == (3, 3, 2)
    assert out[0].tolist() == [[0, 1], [2, 3], [4, 5]]
    assert out[1].tolist() == [[6, 7], [-1, -1], [-1, -1]]
    assert out[2].tolist() == [[8, 9], [10, 11], [-1, -1]]
    with pytest.raises(ValueError, match="rows"):
        pad_ragged(flat, [3, 1, 1], width=3)
    with pytest.raises(ValueError, match="seq_lens"):
        pad_ragged(flat, [4, 1, 1], width=3)


@pytest.mark.parametrize("call, match", [
    (lambda: verify_sample_batch(torch.zeros(2, 3, dtype=torch.long), None, torch.rand(2, 3, 5), [3, 3], _gen(0)),
     "target_probs"),
    (lambda: verify_sample_batch(torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3, 4), torch.rand(2, 4, 5),
                                 [3, 3], _gen(0)), "draft_probs"),
    (lambda: verify_sample_batch(torch.zeros(2, 3, dtype=torch.long), None, torch.rand(2, 4, 5), [4, 3], _gen(0)),
     "lengths"),
    (lambda: verify_sample_batch(torch.zeros(2, 3, dtype=torch.long), None, torch.rand(2, 4, 5), [3], _gen(0)),
     "lengths"),
    (lambda: verify_sample_batch(torch.zeros(2, 3, dtype=torch.long), None, torch.rand(2, 4, 5), [3, 3], None),
     "generator"),
    (lambda: verify_sample_batch(torch.zeros(2, 3), None, torch.rand(2, 4, 5), [3, 3], _gen(0)), "draft_tokens"),
    (lambda: verify_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(4, dtype=torch.long)), "draft_tokens"),
    (lambda: verify_greedy(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)), "target"),
    (lambda: verify_greedy_batch(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long),
                                 torch.tensor([1, -1])), "lengths"),
])
def test_bad_inputs_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# Laws of the accepted count and of the correction token (context-free p_j, q_j)


def test_accepted_count_and_residual_laws_chi_square():
    # With position-wise independent p_j, q_j: P(accept at j) = β_j = Σ_v min(p_j, q_j)(v), so
    # A ~ [1−β0, β0(1−β1), β0β1(1−β2), β0β1β2]; given A = 0 the emitted token follows the
    # normalised residual max(0, p_0 − q_0).
    g = _gen(8)
    vocab, width, rows = 6, 3, 100_000
    p = torch.softmax(torch.randn(width + 1, vocab, generator=g), -1).double()
    q = torch.softmax(torch.randn(width, vocab, generator=g), -1).double()
    drafts = sample(q.float().expand(rows, -1, -1), g)
    n, nxt = verify_sample_batch(drafts, q.float().expand(rows, -1, -1), p.float().expand(rows, -1, -1),
                                 [width] * rows, g)
    beta = torch.minimum(p[:width], q).sum(-1)
    law = torch.stack([1 - beta[0], beta[0] * (1 - beta[1]), beta[0] * beta[1] * (1 - beta[2]), beta.prod()])
    counts = torch.bincount(n, minlength=width + 1).double()
    assert chisquare(counts.numpy(), (rows * law).numpy())[1] > 1e-3
    residual = (p[0] - q[0]).clamp_min(0)
    residual = residual / residual.sum()
    after_reject = torch.bincount(nxt[n == 0], minlength=vocab).double()
    support = residual > 0
    assert (after_reject[~support] == 0).all()
    exp = after_reject.sum() * residual[support]
    assert chisquare(after_reject[support].numpy(), exp.numpy())[1] > 1e-3


def test_host_greedy_acceptance_equals_verify_greedy():
    """`accept_greedy` on host argmax ids (the batched round's greedy path) agrees with
    `verify_greedy` on the logits, including planted ties (lowest id wins in both)."""
    from dspark.verify.acceptance import accept_greedy

    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        k, vocab = int(torch.randint(0, 6, (1,), generator=g)), 7
        logits = torch.randn(k + 1, vocab, generator=g)
        if trial % 3 == 0:  # a tie between two ids on some rows
            logits[:, 5] = logits[:, 2]
        target = logits.argmax(-1)
        drafts = torch.where(torch.rand(k, generator=g) < 0.7, target[:k], torch.randint(0, vocab, (k,), generator=g))
        expected = verify_greedy(drafts, logits)
        assert accept_greedy(drafts.tolist(), target.tolist()) == (int(expected[0]), int(expected[1]))
