"""dspark.verify.planner: hand-computed decisions, async staleness, and exact (non-)losslessness."""

import itertools

import pytest
import torch

from dspark.verify.capacity import CapacityTable
from dspark.verify.planner import (VerifyPlan, async_budget, expected_tokens, plan_algorithm1, plan_async,
                                   plan_fixed, select_top_k, survival, throughput)


def _table(points, label="hand-made"):
    bt = sorted(points)
    return CapacityTable(tuple(bt), tuple(points[b] for b in bt), label)


# ---------------------------------------------------------------------------------------------
# Fixed budget


@pytest.mark.parametrize("gamma", [1, 3, 5, 7])
def test_fixed_budget_verifies_the_first_min_n_gamma_drafts(gamma):
    for n in range(0, gamma + 3):
        plan = plan_fixed(n, gamma, num_requests=3)
        assert plan.draft_lens == (min(n, gamma),) * 3
        assert plan.verify_lens == (min(n, gamma) + 1,) * 3
        assert plan.batch_tokens == 3 * (min(n, gamma) + 1)
    assert plan_fixed(4, 5, 3, max_lens=[5, 2, 0]).draft_lens == (4, 2, 0)
    with pytest.raises(ValueError, match="draft_tokens"):
        plan_fixed(-1, gamma, 3)
    with pytest.raises(ValueError, match="max_lens"):
        plan_fixed(2, gamma, 2, max_lens=[gamma + 1, 0])


# ---------------------------------------------------------------------------------------------
# Algorithm 1 on hand-computed cases


def test_algorithm1_hand_computed_two_requests():
    # c = [[0.9, 0.8, 0.5], [0.6, 0.5, 1.0]] -> a = [[0.9, 0.72, 0.36], [0.6, 0.3, 0.3]].
    # Walk: start Θ = 2·SPS(2) = 20
    #   (0,0) a=0.9 : τ=2.9,  B=3: 2.9·9.5  = 27.55 > 20    commit
    #   (0,1) a=0.72: τ=3.62, B=4: 3.62·9   = 32.58 > 27.55 commit
    #   (1,0) a=0.6 : τ=4.22, B=5: 4.22·8   = 33.76 > 32.58 commit
    #   (0,2) a=0.36: τ=4.58, B=6: 4.58·6   = 27.48         stop
    # -> ℓ = (2, 1), τ = 4.22, Θ = 33.76.
    sps = _table({2: 10, 3: 9.5, 4: 9, 5: 8, 6: 6, 7: 5, 8: 4})
    conf = [[0.9, 0.8, 0.5], [0.6, 0.5, 1.0]]
    plan = plan_algorithm1(conf, sps)
    assert plan == VerifyPlan((2, 1))
    assert expected_tokens(conf, plan) == pytest.approx(4.22)
    assert throughput(conf, plan, sps) == pytest.approx(33.76)
    torch.testing.assert_close(survival(conf), torch.tensor([[0.9, 0.72, 0.36], [0.6, 0.3, 0.3]],
                                                            dtype=torch.float64))


def test_algorithm1_early_stop_is_kept_even_when_a_later_length_is_better():
    # R = 1, a = (0.8, 0.8): Θ(0) = 1, Θ(1) = 1.8·0.5 = 0.9 (stop), although Θ(2) = 2.6·0.49 = 1.274.
    # The stop is what makes Algorithm 1 lossless; the unconstrained search picks 2.
    sps = _table({1: 1.0, 2: 0.5, 3: 0.49})
    assert plan_algorithm1([[0.8, 1.0]], sps).draft_lens == (0,)
    assert async_budget([[0.8, 1.0]], 2, sps) == 2


def test_algorithm1_ties_go_to_earlier_positions_then_earlier_requests():
    # a = [[0.5, 0.5], [0.5, 0.5]]: order (0,0), (1,0), (0,1), (1,1). SPS flat to B=4, then a cliff:
    # Θ = 2, 2.5, 3, 3.5·0.1 -> two admissions: one per request (position first).
    sps = _table({2: 1.0, 4: 1.0, 5: 0.1})
    assert plan_algorithm1([[0.5, 1.0], [0.5, 1.0]], sps).draft_lens == (1, 1)
    # Top-3 by the same ranking: the third candidate is (0, 1), request 0 first.
    assert select_top_k([[0.5, 1.0], [0.5, 1.0]], 3).draft_lens == (2, 1)


def test_algorithm1_skips_zero_survival_and_respects_max_lens():
    flat = _table({1: 1.0, 64: 1.0})  # uninitialised (flat) table: verify every a > 0
    assert plan_algorithm1([[1.0, 0.0, 1.0], [0.5, 0.5, 0.5]], flat).draft_lens == (1, 3)
    assert plan_algorithm1([[1.0, 0.9, 0.9], [0.5, 0.5, 0.5]], flat, max_lens=[2, 0]).draft_lens == (2, 0)
    assert plan_algorithm1(torch.zeros(0, 3), flat).draft_lens == ()


def test_algorithm1_admissions_are_prefixes_and_do_not_depend_on_later_confidences():
    sps = _table({b: 1.0 / (1.0 + 0.08 * b) for b in range(1, 40)})
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        conf = torch.rand(4, 5, generator=g) ** 0.3
        plan = plan_algorithm1(conf, sps)
        # Changing the confidence of the first non-admitted position of every request can only
        # change admissions at or after it: lowering it never removes an admitted draft.
        lowered = conf.clone()
        for r, n in enumerate(plan.draft_lens):
            if n < 5:
                lowered[r, n] = 0.0
        assert plan_algorithm1(lowered, sps) == plan


def test_planner_input_validation():
    sps = _table({1: 1.0, 8: 0.5})
    for bad in ([[1.2, 0.5]], [[float("nan"), 0.5]], [[-0.1, 0.5]]):
        with pytest.raises(ValueError, match="confidence"):
            plan_algorithm1(bad, sps)
    with pytest.raises(ValueError, match="budget"):
        select_top_k([[0.5]], -1)
    with pytest.raises(ValueError, match="stale_confidence"):
        plan_async([[0.5, 0.5]], [None, None], sps)
    with pytest.raises(ValueError, match="draft_lens"):
        VerifyPlan((1, -1))


# ---------------------------------------------------------------------------------------------
# Asynchronous variant


def test_async_budget_uses_stale_confidences_and_selection_uses_current_ones():
    # Stale: request 0 had c = (0.9, 0.5) -> a = (0.9, 0.45); request 1 is new (None) -> a = (1, 1).
    # Sorted stale survivals 1, 1, 0.9, 0.45; Θ(b) = (2 + S_b)·SPS(2 + b):
    #   b=0: 2·10 = 20, b=1: 3·9 = 27, b=2: 4·8 = 32, b=3: 4.9·5 = 24.5, b=4: 5.35·4 = 21.4 -> K = 2.
    # Current c = [[0.3, 0.9], [0.8, 0.7]] -> a = [[0.3, 0.27], [0.8, 0.56]]: top-2 = (1,0), (1,1).
    sps = _table({2: 10, 3: 9, 4: 8, 5: 5, 6: 4})
    stale = [[0.9, 0.5], None]
    current = [[0.3, 0.9], [0.8, 0.7]]
    assert async_budget(stale, 2, sps) == 2
    assert plan_async(current, stale, sps).draft_lens == (0, 2)
    # The budget ignores the current confidences entirely ...
    for other in ([[1.0, 1.0], [1.0, 1.0]], [[0.01, 0.01], [0.9, 0.01]]):
        assert plan_async(other, stale, sps).num_drafts == min(2, sum(a > 0 for row in survival(other).tolist()
                                                                   for a in row))
    # ... and follows the stale ones: pessimistic history shrinks it.
    assert async_budget([[0.1, 0.1], [0.1, 0.1]], 2, sps) == 0
    assert plan_async(current, [[0.1, 0.1], [0.1, 0.1]], sps).draft_lens == (0, 0)


def test_async_budget_ties_pick_the_smallest_budget_and_empty_batches():
    sps = _table({1: 1.0, 2: 0.5, 3: 1 / 3})  # Θ(b) = (1 + b)/(1 + b) = 1 for a = 1: all tie
    assert async_budget([[1.0, 1.0]], 2, sps) == 0
    assert async_budget([], 3, sps) == 0
    assert select_top_k([[0.9, 0.9]], 10).draft_lens == (2,)


# ---------------------------------------------------------------------------------------------
# Exact output laws: retrospective scheduling is biased, non-anticipating scheduling is not
#
# One round, one request, γ = 2, by exhaustive enumeration of the drafts (x1, x2). Given the
# drafts and the scheduled length ℓ, the law of the first two emitted tokens is
#   ℓ = 0: t1 ~ p0, t2 ~ p(· | t1)                       (t2 from the next round, exact)
#   ℓ >= 1: accept x1 w.p. α1 = min(1, p0(x1)/q1(x1)), else t1 ~ res(p0, q1), t2 ~ p(· | t1)
#           after acceptance: ℓ = 1 -> t2 ~ p(· | x1) (bonus); ℓ = 2 -> accept x2 w.p. α2, else residual.
# Confidences: c1 is fixed, c2 = c2(x1) is computed from x1 (the Markov embedding), as in DSpark.


def _residual(p, q):
    r = (p - q).clamp_min(0)
    return r / r.sum() if r.sum() > 0 else p


def _emitted_law(p0, p_next, q1, q2, schedule):
    """Exact joint law [V, V] of the first two emitted tokens under `schedule(x1, x2) -> ℓ`.

    p0 [V], p_next [V, V] (target after token v), q1 [V], q2 [V, V] (drafter after x1), float64.
    """
    vocab = p0.numel()
    law = torch.zeros(vocab, vocab, dtype=torch.float64)
    for x1, x2 in itertools.product(range(vocab), repeat=2):
        w = q1[x1] * q2[x1, x2]
        if w == 0:
            continue
        ell = schedule(x1, x2)
        if ell == 0:
            law += w * p0[:, None] * p_next
            continue
        a1 = min(1.0, float(p0[x1] / q1[x1]))
        r1 = _residual(p0, q1)
        law += w * (1 - a1) * r1[:, None] * p_next
        if ell == 1:
            law[x1] += w * a1 * p_next[x1]
        else:
            a2 = min(1.0, float(p_next[x1, x2] / q2[x1, x2]))
            law[x1, x2] += w * a1 * a2
            law[x1] += w * a1 * (1 - a2) * _residual(p_next[x1], q2[x1])
    return law


def _target_law(p0, p_next):
    return p0[:, None] * p_next


def test_appendix_a_counterexample_exact():
    # Paper Appendix A: target (0.7, 0.3), draft (0.5, 0.5), SPS(1, 2, 3) = (1, 0.5, 0.45),
    # a_1 = 0.8; c2 = 1 after A (token 0) and 0 after B (token 1).
    p0 = torch.tensor([0.7, 0.3], dtype=torch.float64)
    q1 = torch.tensor([0.5, 0.5], dtype=torch.float64)
    p_next = torch.tensor([[0.6, 0.4], [0.2, 0.8]], dtype=torch.float64)
    q2 = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64)
    c2 = {0: 1.0, 1: 0.0}
    sps = _table({1: 1.0, 2: 0.5, 3: 0.45})

    def conf(x1):
        return [[0.8, c2[x1]]]

    # Retrospective: the global search over all lengths with the *current* confidences
    # (x1 = A: Θ(2) = 2.6·0.45 = 1.17 > 1 -> ℓ = 2; x1 = B: Θ(2) = 1.8·0.45 = 0.81 -> ℓ = 0).
    def retrospective(x1, x2):
        return select_top_k(conf(x1), async_budget(conf(x1), 2, sps)).draft_lens[0]

    def algorithm1(x1, x2):
        return plan_algorithm1(conf(x1), sps).draft_lens[0]

    biased = _emitted_law(p0, p_next, q1, q2, retrospective)
    torch.testing.assert_close(biased.sum(1), torch.tensor([0.85, 0.15], dtype=torch.float64))
    exact = _emitted_law(p0, p_next, q1, q2, algorithm1)
    torch.testing.assert_close(exact, _target_law(p0, p_next), rtol=0, atol=1e-12)


def test_data_dependent_but_non_anticipating_lengths_are_exact():
    # Random 3-token world. Algorithm 1 with a capacity under which its choice *does* depend on
    # x1 (through c2(x1)), async top-K with a budget fixed beforehand, and a fixed budget are all
    # exact; the global search over current confidences and an oracle that admits a draft only if
    # the target would surely accept it (p >= q) are biased.
    g = torch.Generator().manual_seed(3)
    vocab = 3
    p0 = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64), 0)
    p_next = torch.softmax(torch.randn(vocab, vocab, generator=g, dtype=torch.float64), 1)
    q1 = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64), 0)
    q2 = torch.softmax(torch.randn(vocab, vocab, generator=g, dtype=torch.float64), 1)
    c2 = [0.95, 0.3, 0.0]  # confidence of the second draft, read from x1
    conf = {x1: [[0.8, c2[x1]]] for x1 in range(vocab)}
    # Θ: ℓ=1 -> 1.8·0.9 = 1.62 > 1; ℓ=2 -> (1.8 + 0.8·c2)·0.7 beats 1.62 iff c2 > 0.64.
    sps = _table({1: 1.0, 2: 0.9, 3: 0.7})
    lengths = {x1: plan_algorithm1(conf[x1], sps).draft_lens[0] for x1 in range(vocab)}
    assert lengths == {0: 2, 1: 1, 2: 1}  # the schedule really depends on x1

    target = _target_law(p0, p_next)
    exact_schedules = {
        "algorithm1": lambda x1, x2: plan_algorithm1(conf[x1], sps).draft_lens[0],
        "async_fixed_budget": lambda x1, x2: select_top_k(conf[x1], 2).draft_lens[0],
        "fixed": lambda x1, x2: plan_fixed(2, 2, 1).draft_lens[0],
        "fixed_1": lambda x1, x2: 1,
    }
    for name, schedule in exact_schedules.items():
        torch.testing.assert_close(_emitted_law(p0, p_next, q1, q2, schedule), target, rtol=0, atol=1e-12,
                                   msg=name)

    big_drop = _table({1: 1.0, 2: 0.5, 3: 0.45})
    biased_schedules = {
        "global_search_on_current": lambda x1, x2: select_top_k(
            conf[x1], async_budget(conf[x1], 2, big_drop)).draft_lens[0],
        "oracle_p_ge_q": lambda x1, x2: (0 if p0[x1] < q1[x1] else 1 if p_next[x1, x2] < q2[x1, x2] else 2),
    }
    for name, schedule in biased_schedules.items():
        tv = 0.5 * (_emitted_law(p0, p_next, q1, q2, schedule) - target).abs().sum()
        assert tv > 0.02, name


def test_async_budget_prices_budget_zero_as_a_plain_step_and_min_budget_excludes_it():
    """K = 0 drafts nothing, so it is priced on the plain curve: with drafting rounds at 30 steps/s and
    plain steps at 50, a stale survival of 0.5 does not pay (1.5 × 30 < 50) and 0.9 does (1.9 × 30)."""
    table = CapacityTable((1, 4), (30.0, 30.0), "drafting rounds", plain_requests=(1, 4),
                          plain_steps_per_second=(50.0, 50.0))
    assert async_budget([[0.5, 0.0]], 2, table) == 0
    assert async_budget([[0.9, 0.0]], 2, table) == 1
    assert async_budget([[0.5, 0.0]], 2, table, min_budget=1) == 1
    no_plain_curve = CapacityTable((1, 4), (30.0, 30.0), "no plain curve")  # K = 0 at SPS(R), as before
    assert async_budget([[0.5, 0.0]], 2, no_plain_curve) == 1
    assert async_budget([[0.0, 0.0]], 2, table, min_budget=1) == 0  # no candidate at all
    with pytest.raises(ValueError, match="min_budget"):
        async_budget([[0.5, 0.0]], 2, table, min_budget=2)
