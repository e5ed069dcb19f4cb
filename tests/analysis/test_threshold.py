"""Threshold sweep replayed from a verify-all trace, against hand-computed truncations (γ = 3).

    round  c_k            A  committed
    R1     .9 .6 .3       3  4
    R2     .9 .2 .9       1  2
    R3     .9 .9 .9       2  2   (accepted stop token at slot 1)
"""

import math

import numpy as np
import pytest

from dspark.analysis import threshold_sweep, truncation_lengths


@pytest.fixture
def trace(record):
    return [record(accepted=3, committed=4, confidence=[0.9, 0.6, 0.3]),
            record(accepted=1, committed=2, confidence=[0.9, 0.2, 0.9]),
            record(accepted=2, committed=2, confidence=[0.9, 0.9, 0.9], stop=True)]


def test_truncation_stops_at_first_miss():
    scores = np.array([[0.9, 0.6, 0.3], [0.9, 0.2, 0.9], [0.4, 0.9, 0.9]])
    assert truncation_lengths(scores, 0.5).tolist() == [2, 1, 0]


def test_sweep_by_hand(trace):
    zero, half, high = threshold_sweep(trace, [0.0, 0.5, 0.95])
    # t = 0: verify-all as recorded.
    assert zero == pytest.approx({"threshold": 0.0, "verified": 3.0, "accepted": 2.0, "rejected": 1.0,
                                  "tokens": 8 / 3, "acceptance_rate": 6 / 9, "verify_rate": 1.0})
    # t = .5: L = 2, 1, 3; accepted min(A, L) = 2, 1, 2; tokens min(committed, acc + 1) = 3, 2, 2.
    assert half == pytest.approx({"threshold": 0.5, "verified": 2.0, "accepted": 5 / 3, "rejected": 1 / 3,
                                  "tokens": 7 / 3, "acceptance_rate": 5 / 6, "verify_rate": 9 / 12})
    # t = .95: nothing verified, every round commits the target's token only.
    assert high["verified"] == 0 and high["tokens"] == 1.0 and math.isnan(high["acceptance_rate"])
    assert high["verify_rate"] == pytest.approx(3 / 12)


def test_survival_criterion_truncates_earlier(trace):
    conf, surv = threshold_sweep(trace, [0.75]), threshold_sweep(trace, [0.75], criterion="survival")
    # R3: c = .9 .9 .9 keeps 3 drafts, its survival .9 .81 .729 keeps 2; R1 and R2 keep 1 either way.
    assert conf[0]["verified"] == pytest.approx(5 / 3) and surv[0]["verified"] == pytest.approx(4 / 3)
    assert conf[0]["tokens"] == surv[0]["tokens"] == pytest.approx(2.0)


def test_capped_rounds_stay_capped(record):
    # A round the length limit cut to ℓ = 1 cannot verify more at any threshold.
    row, = threshold_sweep([record(verified=1, accepted=1, confidence=[0.9, 0.9, 0.9])], [0.0])
    assert row["verified"] == 1 and row["tokens"] == 2


def test_bad_arguments(trace, record):
    with pytest.raises(ValueError, match="criterion must be one of"):
        threshold_sweep(trace, [0.5], criterion="cumprod")
    with pytest.raises(ValueError, match="thresholds must be finite numbers, got nan"):
        threshold_sweep(trace, [float("nan")])
    with pytest.raises(ValueError, match="carry no confidences"):
        threshold_sweep([record(confidence=[])], [0.5])
