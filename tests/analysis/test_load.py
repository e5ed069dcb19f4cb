"""Budget and modelled throughput per concurrency, and the frontier, on a three-step trace.

Capacity: probes (1, 11) at (100, 50) steps/s, so step time = 10 ms + 1 ms × (B − 1).

    step  load  records (ℓ, A, committed)        B = Σ(1 + ℓ)  committed  step time
    0     2     a (3, 2, 3), b (1, 0, 1)         6             4          15 ms
    1     2     a (3, 3, 4), b (3, 1, 2)         8             6          17 ms
    2     1     a (2, 2, 3)                      3             3          12 ms
"""

import pytest

from dspark.analysis import frontier, load_table, number_steps, step_table
from dspark.verify.capacity import CapacityTable

CAPACITY = CapacityTable((1, 11), (100.0, 50.0), "test: 10 ms + 1 ms per extra token")


@pytest.fixture
def trace(record):
    return number_steps([
        record("a", verified=3, accepted=2, load=2), record("b", verified=1, accepted=0, load=2),
        record("a", verified=3, accepted=3, load=2), record("b", verified=3, accepted=1, load=2),
        record("a", verified=2, accepted=2, load=1)])


def test_step_table(trace):
    s = step_table(trace)
    assert s["step"].tolist() == [0, 1, 2] and s["load"].tolist() == [2, 2, 1]
    assert s["batch_tokens"].tolist() == [6, 8, 3] and s["verified"].tolist() == [4, 6, 2]
    assert s["committed"].tolist() == [4, 6, 3]


def test_load_table_by_hand(trace):
    one, two = load_table(trace, CAPACITY)
    assert one == pytest.approx({"load": 1, "steps": 1, "verify_tokens": 3.0, "drafts_verified": 2.0, "tau": 3.0,
                                 "batch_tokens": 3.0, "step_time_s": 0.012, "throughput": 250.0,
                                 "per_user": 250.0})
    assert two == pytest.approx({"load": 2, "steps": 2, "verify_tokens": 3.5, "drafts_verified": 2.5, "tau": 2.5,
                                 "batch_tokens": 7.0, "step_time_s": 0.016, "throughput": 10 / 0.032,
                                 "per_user": 10 / 0.064})


def test_frontier_flags_dominated_points(trace):
    rows = load_table(trace, CAPACITY) + [{"load": 4, "per_user": 100.0, "throughput": 200.0}]
    points = frontier(rows)
    assert [p["load"] for p in points] == [4, 2, 1]                # ascending tokens/s per user
    assert [p["pareto"] for p in points] == [False, True, True]    # load 4 is beaten by load 2 on both axes


def test_steps_are_required(record):
    with pytest.raises(ValueError, match="lack the `step` field"):
        step_table([record()])
    with pytest.raises(ValueError, match="step 0: its record count disagrees"):
        step_table([record("a", load=2, step=0)])
