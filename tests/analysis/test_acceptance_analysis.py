"""τ, survival and conditional acceptance on a five-round trace computed by hand (γ = 3).

    round  request  domain    ℓ  A  committed  note
    R1     a        gsm8k     3  3  4          bonus
    R2     a        gsm8k     3  1  2
    R3     b        mt-bench  3  0  1
    R4     b        mt-bench  2  2  3          planner verified 2: bonus
    R5     b        mt-bench  3  2  2          accepted stop token at slot 1: no bonus
"""

import math

import numpy as np
import pytest

from dspark.analysis import (accept_histogram, acceptance_rate, category_means, conditional_acceptance,
                             domain_table, prefix_survival, summary_row, tau, tau_histogram, tau_per_request,
                             verify_rate)


@pytest.fixture
def trace(record):
    return [record("a", verified=3, accepted=3, committed=4, domain="gsm8k"),
            record("a", verified=3, accepted=1, committed=2, domain="gsm8k"),
            record("b", verified=3, accepted=0, committed=1, domain="mt-bench"),
            record("b", verified=2, accepted=2, committed=3, domain="mt-bench"),
            record("b", verified=3, accepted=2, committed=2, domain="mt-bench", stop=True)]


def test_tau_counts_bonus_and_stops(trace):
    assert tau(trace) == pytest.approx(12 / 5)           # (4 + 2 + 1 + 3 + 2) / 5
    assert tau_per_request(trace) == {"a": 3.0, "b": 2.0}
    assert tau_histogram(trace).tolist() == [0, 1, 2, 1, 1]
    assert accept_histogram(trace).tolist() == [1, 1, 2, 1]


def test_prefix_survival_is_unconditional(trace):
    # slot 0: 4 of 5 rounds accepted it; slot 1: 3 of 5; slot 2: 1 of the 4 rounds that verified it.
    np.testing.assert_allclose(prefix_survival(trace), [4 / 5, 3 / 5, 1 / 4])


def test_conditional_acceptance_judges_each_slot_alone(trace):
    # slot 1 reached by R1, R2, R4, R5 (A ≥ 1, ℓ ≥ 2): 3 accepted; slot 2 reached by R1, R5 only.
    np.testing.assert_allclose(conditional_acceptance(trace), [4 / 5, 3 / 4, 1 / 2])


def test_rates(trace):
    assert verify_rate(trace) == pytest.approx(19 / 20)
    assert acceptance_rate(trace) == pytest.approx(8 / 14)


def test_unreached_positions_are_nan(record):
    trace = [record(verified=1, accepted=0)]
    survival, conditional = prefix_survival(trace), conditional_acceptance(trace)
    assert survival[0] == 0.0 and math.isnan(survival[1]) and math.isnan(conditional[2])


def test_domain_table_and_category_means(trace):
    rows = domain_table(trace)
    assert [(r["domain"], r["category"], r["requests"], r["rounds"], r["tokens"]) for r in rows] == [
        ("gsm8k", "math", 1, 2, 6), ("mt-bench", "chat", 1, 3, 6)]
    assert [r["tau"] for r in rows] == [3.0, 2.0]
    np.testing.assert_allclose(rows[1]["accept_rate_at_k"], [2 / 3, 2 / 3, 0.0])
    assert category_means(rows) == {"math": 3.0, "chat": 2.0, "all": 2.5}
    assert [r["domain"] for r in domain_table(trace, ["mt-bench"])] == ["mt-bench"]
    with pytest.raises(ValueError, match="domain 'mbpp' has no rounds"):
        domain_table(trace, ["mbpp"])


def test_summary_row(trace):
    row = summary_row(trace)
    assert row["tau"] == pytest.approx(2.4) and row["tau_request_mean"] == pytest.approx(2.5)
    assert row["bonus_rate"] == pytest.approx(2 / 5) and row["mean_verified"] == pytest.approx(14 / 5)
    assert row["accept_hist"] == [1, 1, 2, 1]


def test_empty_trace_is_an_error():
    with pytest.raises(ValueError, match="no rounds"):
        tau([])
