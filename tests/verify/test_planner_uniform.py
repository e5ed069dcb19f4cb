"""`uniform_budget`: one verify budget for every request of a round, from stale confidences only.

Checked by hand on small cases, against a brute-force Θ over every n, and for its validation."""

import itertools

import pytest
import torch

from dspark.verify.capacity import CapacityTable, default_cpu_table
from dspark.verify.planner import expected_tokens, plan_fixed, uniform_budget


def _table(points):
    bt = sorted(points)
    return CapacityTable(tuple(bt), tuple(points[b] for b in bt), "hand-made")


def test_uniform_budget_by_hand():
    # Two requests, γ = 3. Stale c: request 0 (0.9, 0.5, 1.0) -> a = (0.9, 0.45, 0.45); request 1 has
    # no stale row -> a = (1, 1, 1). τ(n) = 2 + (1.9, 3.35, 4.8)[n-1] = 3.9, 5.35, 6.8 at B = 4, 6, 8.
    # SPS(4, 6, 8) = (10, 8, 5): Θ = 39, 42.8, 34 -> n = 2.
    sps = _table({2: 12, 4: 10, 6: 8, 8: 5})
    assert uniform_budget([[0.9, 0.5, 1.0], None], 3, sps) == 2
    # A pessimistic history shrinks it to the floor of 1 (n = 0 is plain decoding, not a DSpark round) ...
    assert uniform_budget([[0.1, 0.1, 0.1], [0.1, 0.1, 0.1]], 3, sps) == 1
    # ... and max_budget caps it.
    assert uniform_budget([None, None], 3, _table({2: 1, 8: 1}), max_budget=2) == 2
    # Ties go to the smallest budget: Θ(n) = 2(1 + n) · 1 / (2(1 + n)) = 1 for survival 1 everywhere.
    flat = CapacityTable(tuple(range(1, 9)), tuple(1 / b for b in range(1, 9)), "1/B")
    assert uniform_budget([None, None], 3, flat) == 1
    assert uniform_budget([], 3, sps) == 0


def test_uniform_budget_is_the_best_uniform_plan():
    """n maximises Θ = τ · SPS(B) over the plans ℓ_r = n of every request (planner.throughput's own τ)."""
    g = torch.Generator().manual_seed(0)
    tables = [default_cpu_table(), _table({1: 50, 8: 48, 9: 20, 24: 15, 64: 6})]
    for rows, table, trial in itertools.product((1, 3, 8), tables, range(5)):
        stale = torch.rand(rows, 5, generator=g) ** 0.3
        n = uniform_budget(list(stale), 5, table)
        theta = [expected_tokens(stale, plan_fixed(m, 5, rows)) * table(rows * (1 + m)) for m in range(1, 6)]
        assert theta[n - 1] == pytest.approx(max(theta)) and all(t < max(theta) for t in theta[:n - 1])


def test_uniform_budget_validates():
    sps = default_cpu_table()
    with pytest.raises(ValueError, match="max_budget must be an int in \\[1, γ=3\\], got 4"):
        uniform_budget([None], 3, sps, max_budget=4)
    with pytest.raises(ValueError, match="max_budget must be an int in \\[1, γ=3\\], got 0"):
        uniform_budget([None], 3, sps, max_budget=0)
    with pytest.raises(ValueError, match="stale_confidence rows must have γ=3 entries, got 2"):
        uniform_budget([[0.5, 0.5]], 3, sps)
    with pytest.raises(ValueError, match="gamma must be an int >= 0, got '3'"):
        uniform_budget([None], "3", sps)
    with pytest.raises(ValueError, match="confidence values must lie in \\[0, 1\\]"):
        uniform_budget([[0.5, 1.5, 0.5]], 3, sps)
