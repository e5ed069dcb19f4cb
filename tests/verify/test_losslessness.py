"""Statistical losslessness of draft → verify: the emitted tokens follow the target exactly.

A tiny world (V = 6, block γ = 3): the target and the drafter are first-order Markov chains whose
next-token distribution depends on the previous token (and, for the drafter, on the block slot),
with fixed random logits; the two disagree substantially. Each sample drafts a block, verifies it,
and keeps going (a second round anchored at the first emitted token) until two tokens are out. The
joint law of those two tokens must equal direct sampling from the target, p(t1 | BOS) p(t2 | t1):
a χ² test over the 36 cells with ≥ 40k samples, at T = 1 and at T = 0.7 with top-p 0.9 (target
probabilities through `probs_from_logits`). The same harness must flag a deliberately biased
verifier (accept with min(1, p/q), but resample from p instead of the residual).
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.sampling import SamplingParams, probs_from_logits, sample
from dspark.verify.acceptance import verify_sample_batch

VOCAB, GAMMA, BOS = 6, 3, 6  # row BOS of a transition table is the distribution after the prompt
SAMPLES = 60_000


def _world(seed):
    g = torch.Generator().manual_seed(seed)
    target_logits = 0.6 * torch.randn(VOCAB + 1, VOCAB, generator=g)  # [prev, V]
    draft_logits = 1.2 * torch.randn(GAMMA, VOCAB + 1, VOCAB, generator=g)  # [slot, prev, V]
    return target_logits, draft_logits


def biased_verify(draft_tokens, draft_probs, target_probs, lengths, generator):
    """The classic bug: correct acceptance test, but the correction is drawn from p, not the residual.

    Shapes as `verify_sample_batch` with draft_probs [R, K, V] (not None).
    """
    rows, width = draft_tokens.shape
    lens = torch.as_tensor(lengths)
    u = torch.rand((rows, width), generator=generator)
    p_tok = target_probs[:, :width].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_tok = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
    accept = (u * q_tok < p_tok) & (torch.arange(width) < lens[:, None])
    n = accept.long().cumprod(-1).sum(-1)
    row = target_probs.gather(1, n.view(rows, 1, 1).expand(rows, 1, VOCAB)).squeeze(1)
    return n, sample(row, generator)


def _draft(prev, draft_probs_table, point_mass, gen):
    """Sample a γ-block per request from the drafter; returns tokens [M, γ], q [M, γ, V] or None."""
    tokens, probs = [], []
    for slot in range(GAMMA):
        q = draft_probs_table[slot, prev]  # [M, V]
        x = q.argmax(-1) if point_mass else sample(q, gen)
        tokens.append(x)
        probs.append(q)
        prev = x
    return torch.stack(tokens, 1), None if point_mass else torch.stack(probs, 1)


def _round(anchor_prev, p_table, q_table, point_mass, lengths_fn, verifier, gen):
    """One draft → verify round for M requests whose last committed token is `anchor_prev` [M].

    Returns (tokens [M, γ+1] committed in order, padded with -1; count [M] committed this round).
    """
    drafts, q = _draft(anchor_prev, q_table, point_mass, gen)
    prevs = torch.cat([anchor_prev[:, None], drafts], 1)  # [M, γ+1] context of each target row
    p = p_table[prevs]  # [M, γ+1, V]
    lengths = lengths_fn(len(anchor_prev), gen)
    n, nxt = verifier(drafts, q, p, lengths, gen)
    out = torch.full((len(anchor_prev), GAMMA + 1), -1)
    out[:, :GAMMA] = torch.where(torch.arange(GAMMA) < n[:, None], drafts, -1)
    out.scatter_(1, n[:, None], nxt[:, None])
    return out, n + 1


def _first_two_tokens(p_table, q_table, point_mass, lengths_fn, verifier, seed):
    gen = torch.Generator().manual_seed(seed)
    out, count = _round(torch.full((SAMPLES,), BOS), p_table, q_table, point_mass, lengths_fn, verifier, gen)
    t1, t2 = out[:, 0].clone(), out[:, 1].clone()
    short = count == 1  # the round emitted one token: the second comes from the next round
    if short.any():
        out2, _ = _round(t1[short], p_table, q_table, point_mass, lengths_fn, verifier, gen)
        t2[short] = out2[:, 0]
    return t1, t2, count - 1


def _chi_square_pvalue(t1, t2, p_table):
    observed = torch.bincount(t1 * VOCAB + t2, minlength=VOCAB * VOCAB).double()
    p64 = p_table.double()
    law = (p64[BOS][:, None] * p64[:VOCAB]).reshape(-1)  # p(t1 | BOS) p(t2 | t1)
    law = law / law.sum()
    support = law > 0
    assert (observed[~support] == 0).all(), "a token outside the target's support was emitted"
    expected = SAMPLES * law[support]
    assert expected.min() >= 5, "test design: every χ² cell needs an expected count >= 5"
    stat, pvalue = chisquare(observed[support].numpy(), expected.numpy())
    return stat, int(support.sum()) - 1, pvalue


def _full_lengths(rows, gen):
    return [GAMMA] * rows


def _random_lengths(rows, gen):
    # Chosen before (and independently of) the drafts: a non-anticipating verify budget.
    return torch.randint(0, GAMMA + 1, (rows,), generator=gen)


CASES = {
    "T1": (SamplingParams(1.0), False, _full_lengths),
    "T0.7_top_p0.9": (SamplingParams(0.7, top_p=0.9), False, _full_lengths),
    "T1_point_mass_drafter": (SamplingParams(1.0), True, _full_lengths),
    "T0.8_top_k4_ragged_lengths": (SamplingParams(0.8, top_k=4), False, _random_lengths),
}


def _tables(params, point_mass=False, seed=1):
    target_logits, draft_logits = _world(seed)
    p_table = probs_from_logits(target_logits, params)  # [V+1, V]: the request's target law
    if point_mass:
        # A deterministic drafter that often, not always, guesses the target's mode (as n-gram
        # lookup does); `_draft` proposes the argmax of each row as a point mass.
        draft_logits = target_logits + 0.5 * draft_logits
    # The drafter samples from its own unfiltered softmax at the request temperature (as SGLang).
    q_table = probs_from_logits(draft_logits, SamplingParams(params.temperature))
    return p_table, q_table


@pytest.mark.parametrize("case", list(CASES))
def test_verification_reproduces_the_target_joint_law(case):
    params, point_mass, lengths_fn = CASES[case]
    p_table, q_table = _tables(params, point_mass)
    t1, t2, accepted = _first_two_tokens(p_table, q_table, point_mass, lengths_fn, verify_sample_batch, seed=123)
    # The world must exercise both paths: rounds rejected at once and rounds accepting >= 2 drafts.
    assert (accepted == 0).float().mean() > 0.02 and (accepted >= 2).float().mean() > 0.02
    stat, dof, pvalue = _chi_square_pvalue(t1, t2, p_table)
    print(f"\n[losslessness] {case}: chi2 = {stat:.1f}, dof = {dof}, p = {pvalue:.4g}")
    assert pvalue > 1e-3


@pytest.mark.parametrize("case", ["T1", "T0.7_top_p0.9"])
def test_harness_rejects_a_verifier_that_resamples_from_the_target(case):
    params, point_mass, lengths_fn = CASES[case]
    p_table, q_table = _tables(params, point_mass)
    t1, t2, _ = _first_two_tokens(p_table, q_table, point_mass, lengths_fn, biased_verify, seed=123)
    stat, dof, pvalue = _chi_square_pvalue(t1, t2, p_table)
    print(f"\n[losslessness] biased {case}: chi2 = {stat:.1f}, dof = {dof}, p = {pvalue:.4g}")
    assert pvalue < 1e-6


def test_filtered_target_really_filters():
    # Guard against a vacuous T=0.7/top-p case: the filter must remove tokens from some rows.
    p_table, _ = _tables(SamplingParams(0.7, top_p=0.9))
    assert (p_table == 0).any() and np.isclose(p_table.sum(-1).numpy(), 1.0).all()
