"""ECE, AUROC, reliability data and STS on cases small enough to compute by hand."""

import math

import numpy as np
import pytest

from dspark.analysis import (auroc, calibration_table, confidence_logits, ece, fit_sts_from_trace, holdout_split,
                             reliability, reliability_by_position, survival_and_labels)
from dspark.verify.sts import StsCalibration


def test_auroc_by_hand():
    # positive/negative pairs: (.9,.8) ✓ (.9,.2) ✓ (.3,.8) ✗ (.3,.2) ✓ -> 3/4
    assert auroc(np.array([0.9, 0.8, 0.3, 0.2]), np.array([1, 0, 1, 0])) == pytest.approx(0.75)
    assert auroc(np.array([0.5, 0.5]), np.array([1, 0])) == pytest.approx(0.5)         # a tie counts ½
    assert math.isnan(auroc(np.array([0.5, 0.7]), np.array([1, 1])))                   # one class only


def test_ece_by_hand():
    # 10 bins: bin 9 holds .9,.9 with labels 1,0 (|1.8 − 1|); bin 1 holds .1,.1 with 0,0 (|0.2 − 0|).
    assert ece(np.array([0.9, 0.9, 0.1, 0.1]), np.array([1, 0, 0, 0]), num_bins=10) == pytest.approx(0.25)


def test_reliability_bins():
    d = reliability(np.array([0.9, 0.9, 0.1, 0.15]), np.array([1, 0, 0, 1]), num_bins=2)
    np.testing.assert_allclose(d.edges, [0.0, 0.5, 1.0])
    assert d.count.tolist() == [2, 2]
    np.testing.assert_allclose(d.mean_pred, [0.125, 0.9])
    np.testing.assert_allclose(d.mean_label, [0.5, 0.5])
    assert math.isnan(reliability(np.array([0.1]), np.array([1]), num_bins=2).mean_pred[1])
    with pytest.raises(ValueError, match="num_bins must be an int >= 1, got 0"):
        reliability(np.array([0.1]), np.array([1]), num_bins=0)


@pytest.fixture
def trace(record):
    # survival cumprod(c): [.8, .4] twice, [.4, .2] twice; the last round verified slot 0 only.
    return [record(gamma=2, verified=2, accepted=2, confidence=[0.8, 0.5]),
            record(gamma=2, verified=2, accepted=1, confidence=[0.8, 0.5]),
            record(gamma=2, verified=2, accepted=0, confidence=[0.4, 0.5]),
            record(gamma=2, verified=2, accepted=1, confidence=[0.4, 0.5]),
            record(gamma=2, verified=1, accepted=1, confidence=[0.9, 0.5])]


def test_survival_labels_and_censoring(trace):
    pred, label, judged = survival_and_labels(trace)
    np.testing.assert_allclose(pred[:4], [[0.8, 0.4], [0.8, 0.4], [0.4, 0.2], [0.4, 0.2]])
    assert label.tolist() == [[1, 1], [1, 0], [0, 0], [1, 0], [1, 0]]
    assert judged[:, 1].tolist() == [True, True, True, True, False]        # slot 1 of R5 never verified


def test_calibration_table_by_hand(trace):
    rows = calibration_table(trace[:4])
    # slot 0: preds .8 .8 .4 .4, labels 1 1 0 1. Positives {.8,.8,.4} vs negative {.4}: 2.5 / 3.
    assert rows[0]["rounds"] == 4 and rows[0]["observed"] == 0.75 and rows[0]["mean_pred"] == pytest.approx(0.6)
    assert rows[0]["auroc"] == pytest.approx(2.5 / 3)
    assert rows[0]["brier"] == pytest.approx((0.04 + 0.04 + 0.16 + 0.36) / 4)
    assert rows[0]["ece"] == pytest.approx((abs(1.6 - 2) + abs(0.8 - 1)) / 4)
    # slot 1: preds .4 .4 .2 .2, labels 1 0 0 0.
    assert rows[1]["auroc"] == pytest.approx(2.5 / 3) and rows[1]["ece"] == pytest.approx((0.2 + 0.4) / 4)
    assert calibration_table(trace)[1]["rounds"] == 4                       # the censored label is left out
    assert [d.count.sum() for d in reliability_by_position(trace)] == [5, 4]


def test_identity_calibration_reproduces_raw_confidences(trace):
    raw = calibration_table(trace)
    same = calibration_table(trace, StsCalibration.identity(2))
    for a, b in zip(raw, same):
        assert a == pytest.approx(b)
    with pytest.raises(ValueError, match="calibration has γ=3, trace has γ=2"):
        calibration_table(trace, StsCalibration.identity(3))


def test_recorded_logits_take_precedence(record):
    t = [record(gamma=2, verified=2, confidence=[0.5, 0.5], logits=[2.0, -1.0])]
    np.testing.assert_allclose(confidence_logits(t), [[2.0, -1.0]])
    t = [record(gamma=1, verified=1, confidence=[0.5])]
    np.testing.assert_allclose(confidence_logits(t), [[0.0]], atol=1e-12)


def _overconfident_trace(record, n=3000, gamma=3, seed=0):
    """Head logits z, true conditional acceptance σ(z / 3): the raw c = σ(z) is over-confident."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.5, 2.0, size=(n, gamma))
    accept = rng.random((n, gamma)) < 1 / (1 + np.exp(-z / 3))
    accepted = np.cumprod(accept, axis=1).sum(axis=1)
    return [record(gamma=gamma, verified=gamma, accepted=int(a), confidence=(1 / (1 + np.exp(-zi))).tolist(),
                   logits=zi.tolist()) for zi, a in zip(z, accepted)]


def test_sts_fixes_calibration_and_keeps_auroc(record):
    trace = _overconfident_trace(record)
    cal = fit_sts_from_trace(trace, objective="nll", dataset="synthetic")
    assert all(2.0 < t < 4.5 for t in cal.temperatures)                   # truth: T = 3 at every slot
    before, after = calibration_table(trace), calibration_table(trace, cal)
    for b, a in zip(before, after):
        assert a["ece"] < b["ece"] / 2
    # Slot 0 scores are σ(z_0/T_0): order preserved exactly. Later slots multiply different
    # temperatures, so only slot 0's AUROC is invariant by construction.
    assert after[0]["auroc"] == pytest.approx(before[0]["auroc"], abs=1e-12)


def test_sts_needs_verify_all_rounds(record):
    with pytest.raises(ValueError, match="no verify-all rounds"):
        fit_sts_from_trace([record(verified=1)])


def test_holdout_split_by_request(record):
    trace = [record(rid) for rid in ["a", "b", "a", "c", "d", "b"]]
    fit, held = holdout_split(trace)
    assert fit.request_id.tolist() == ["a", "a", "c"] and held.request_id.tolist() == ["b", "d", "b"]
    fit, held = holdout_split(trace, folds=3)
    assert held.request_id.tolist() == ["c"]
    with pytest.raises(ValueError, match="folds must be an int >= 2, got 1"):
        holdout_split(trace, folds=1)
