"""`uniform_budget`: one verify budget for every request of a round, from stale confidences only.

Checked by hand on small cases, against a brute-force Θ over every n (from 1, or from 0 = plain
decoding with `min_budget=0`), on the H200 cells where plain decoding won, and for its validation."""

import itertools

import pytest
import torch

from dspark.verify.capacity import CapacityTable, default_cpu_table
from dspark.verify.planner import _stale_survival, expected_tokens, plan_fixed, uniform_budget


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


def test_short_stale_rows_let_the_budget_grow_one_slot_a_round():
    # A round that drafted w of γ slots leaves rows of w confidences: survival 0 past them. Every
    # drafted token pays here (SPS flat up to 8 tokens), so the budget is the row's width: it can
    # reach γ only a slot at a time, as each round drafts one past its budget.
    sps = _table({2: 10, 8: 10})
    assert uniform_budget([[1.0, 1.0], [1.0, 1.0]], 3, sps) == 2
    assert uniform_budget([[1.0, 1.0, 1.0], [1.0, 1.0]], 3, sps) == 3  # request 0's third slot earns it
    assert uniform_budget([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], 3, sps) == 3
    # Without the extra slot (a row as wide as the budget), no growth: the same table keeps it at 1.
    assert uniform_budget([[1.0], [1.0]], 3, sps) == 1


def test_stale_rows_of_mixed_widths_keep_their_order():
    """Short rows are padded with confidence 0 (survival 0 past their end) in place, whatever the mix of
    widths, None rows (survival 1) and dtypes; equal to padding each row by hand."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.rand(w, generator=g) for w in (2, 5, 1, 2, 3, 5, 1)]
    rows.insert(3, None)
    rows.append(torch.rand(4, generator=g, dtype=torch.float64))
    want = torch.stack([torch.ones(5, dtype=torch.float64) if r is None else
                        torch.cat([r.double(), torch.zeros(5 - r.numel(), dtype=torch.float64)]) for r in rows])
    got = _stale_survival(rows, 5)
    assert got.dtype == torch.float64 and torch.equal(got, torch.cumprod(want, dim=1))


def test_uniform_budget_is_the_best_uniform_plan():
    """n maximises Θ = τ · SPS(B) over the plans ℓ_r = n of every request (planner.throughput's own τ)."""
    g = torch.Generator().manual_seed(0)
    tables = [default_cpu_table(), _table({1: 50, 8: 48, 9: 20, 24: 15, 64: 6})]
    for rows, table, floor, trial in itertools.product((1, 3, 8), tables, (0, 1), range(5)):
        stale = torch.rand(rows, 5, generator=g) ** 0.3
        n = uniform_budget(list(stale), 5, table, min_budget=floor)
        theta = [expected_tokens(stale, plan_fixed(m, 5, rows)) * table(rows * (1 + m)) for m in range(floor, 6)]
        i = n - floor
        assert theta[i] == pytest.approx(max(theta)) and all(t < max(theta) for t in theta[:i])


def test_uniform_budget_validates():
    sps = default_cpu_table()
    with pytest.raises(ValueError, match="max_budget must be an int in \\[1, γ=3\\], got 4"):
        uniform_budget([None], 3, sps, max_budget=4)
    with pytest.raises(ValueError, match="max_budget must be an int in \\[1, γ=3\\], got 0"):
        uniform_budget([None], 3, sps, max_budget=0)
    with pytest.raises(ValueError, match="min_budget must be an int in \\[0, max_budget=2\\], got 3"):
        uniform_budget([None], 3, sps, max_budget=2, min_budget=3)
    with pytest.raises(ValueError, match="min_budget must be an int in \\[0, max_budget=3\\], got -1"):
        uniform_budget([None], 3, sps, min_budget=-1)
    with pytest.raises(ValueError, match="min_budget must be an int in \\[0, max_budget=3\\], got True"):
        uniform_budget([None], 3, sps, min_budget=True)
    with pytest.raises(ValueError, match="stale_confidence rows must have 1 .. γ=3 entries, got shape \\(4,\\)"):
        uniform_budget([[0.5, 0.5, 0.5, 0.5]], 3, sps)
    with pytest.raises(ValueError, match="got shape \\(0,\\)"):
        uniform_budget([[]], 3, sps)
    with pytest.raises(ValueError, match="gamma must be an int >= 0, got '3'"):
        uniform_budget([None], "3", sps)
    with pytest.raises(ValueError, match="confidence values must lie in \\[0, 1\\]"):
        uniform_budget([[0.5, 1.5, 0.5]], 3, sps)


def test_uniform_budget_may_choose_plain_decoding():
    # Two requests, γ = 3, stale c = 0.5 everywhere: a = (0.5, 0.25, 0.125) per request, so
    # τ(0..3) = 2, 3, 3.5, 3.75 at B = 2, 4, 6, 8 (n = 0: the anchors only, plain decoding).
    stale = [[0.5] * 3] * 2
    # SPS(2, 4, 6, 8) = (10, 6, 5, 4): Θ = 20, 18, 17.5, 15 -> plain decoding pays most ...
    plain_pays = _table({2: 10, 4: 6, 6: 5, 8: 4})
    assert uniform_budget(stale, 3, plain_pays, min_budget=0) == 0
    assert uniform_budget(stale, 3, plain_pays) == 1  # ... which the default floor of 1 never picks
    # SPS(4) = 8: Θ = 20, 24, 21, 15 -> one draft pays.
    assert uniform_budget(stale, 3, _table({2: 10, 4: 8, 6: 6, 8: 4}), min_budget=0) == 1
    # Ties go to plain decoding: nothing survives, so every budget commits R tokens at a lower SPS.
    assert uniform_budget([[0.0] * 3] * 2, 3, _table({2: 10, 8: 10}), min_budget=0) == 0
    assert uniform_budget([], 3, plain_pays, min_budget=0) == 0


def test_plain_decoding_is_priced_by_the_plain_curve():
    """With a plain curve (`dspark profile`'s plain steps) budget 0 reads SPS_plain(R), not SPS(B = R):
    the same width curve picks plain decoding or not depending on what a plain step of R costs."""
    stale = [[0.5] * 3] * 2  # τ(0..3) = 2, 3, 3.5, 3.75 at B = 2, 4, 6, 8
    width = {2: 10, 4: 6, 6: 5, 8: 4}  # Θ(1..3) = 18, 17.5, 15
    cheap = CapacityTable.from_step_times({b: [1 / s] for b, s in width.items()}, "t", plain_samples={2: [1 / 10]})
    dear = CapacityTable.from_step_times({b: [1 / s] for b, s in width.items()}, "t", plain_samples={2: [1 / 8]})
    assert uniform_budget(stale, 3, _table(width), min_budget=0) == 0  # SPS(2) = 10: Θ(0) = 20
    assert uniform_budget(stale, 3, cheap, min_budget=0) == 0  # plain step as fast as B = 2
    assert uniform_budget(stale, 3, dear, min_budget=0) == 1  # a plain step of 2 requests at 8/s: Θ(0) = 16
    assert uniform_budget(stale, 3, dear) == 1 and uniform_budget(stale, 3, dear, min_budget=2) == 2


def _h200_cells(requests: int, tok_s: dict[int, float]) -> CapacityTable:
    """A table as `bench/engine_h200.py --table-from-cells` builds it: the pipelined step of the fixed
    cells (budget 0 = plain decoding at B = R), here from their tok/s at constant confidence 0.8629."""
    per_request = {0: 1.0, 1: 1.863, 2: 2.607, 3: 3.25}  # Σ_{k<=n} 0.8629^k, the bench's conversion
    return CapacityTable.from_step_times({requests * (1 + n): [requests * per_request[n] / tok_s[n]]
                                          for n in tok_s}, "H200 4K cells (bench/README.md, tenth session c)")


def test_uniform_budget_on_the_h200_cells():
    """The tenth session's 4K cells: at 256 requests plain decoding was best (32 120 tok/s vs 30 549 for
    budget 3) and the planner now picks it; at 64 requests budget 3 (19 460 vs 13 156) stays."""
    stale = lambda r: [[0.8629] * 5] * r  # noqa: E731
    big = _h200_cells(256, {0: 32120, 1: 23211, 2: 29368, 3: 30549})
    assert uniform_budget(stale(256), 5, big, max_budget=3, min_budget=0) == 0
    assert uniform_budget(stale(256), 5, big, max_budget=3) == 3
    mid = _h200_cells(64, {0: 13156, 1: 13008, 2: 16838, 3: 19460})
    assert uniform_budget(stale(64), 5, mid, max_budget=3, min_budget=0) == 3
