"""dspark.verify.sts: ECE, fitting on synthetic miscalibrated data, JSON round trip."""

import pytest
import torch

from dspark.verify.sts import (StsCalibration, confidence_nll, expected_calibration_error, fit_sts, prefix_ece,
                               prefix_labels)

SCALES = (2.5, 3.0, 0.5, 1.5)  # raw logit = scale × true logit: > 1 over-confident, < 1 under-confident


def _synthetic(n=20_000, seed=0):
    """Verify-all rounds with known truth: c_k = σ(t_k), the head reports z_k = s_k · t_k."""
    g = torch.Generator().manual_seed(seed)
    t = 1.0 + 1.5 * torch.randn(n, len(SCALES), generator=g, dtype=torch.float64)
    accepted = torch.rand(n, len(SCALES), generator=g, dtype=torch.float64) < torch.sigmoid(t)
    num_accepted = accepted.long().cumprod(1).sum(1)  # leading run of accepts
    return (t * torch.tensor(SCALES, dtype=torch.float64)).float(), num_accepted


def test_ece_hand_computed():
    pred = torch.tensor([0.1, 0.12, 0.9, 0.95])
    label = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # 20 bins: {0.1, 0.12} share bin 2: |0.22 − 1|; 0.9 -> bin 18: |0.9 − 1|; 0.95 -> bin 19: |0.95 − 1|.
    assert expected_calibration_error(pred, label) == pytest.approx((0.78 + 0.1 + 0.05) / 4)
    assert expected_calibration_error(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])) == 0.0
    assert expected_calibration_error(torch.zeros(0), torch.zeros(0)) == 0.0
    with pytest.raises(ValueError, match="pred"):
        expected_calibration_error(torch.zeros(3), torch.zeros(4))


def test_prefix_labels():
    y = prefix_labels(torch.tensor([0, 2, 3]), 3)
    assert y.tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    with pytest.raises(ValueError, match="num_accepted"):
        prefix_labels(torch.tensor([4]), 3)


def test_nll_fit_recovers_the_miscalibration_and_lowers_nll_and_ece():
    z, a = _synthetic()
    cal = fit_sts(z, a, objective="nll", dataset="synthetic")
    for fitted, true in zip(cal.temperatures, SCALES):
        assert fitted == pytest.approx(true, rel=0.12)
    assert confidence_nll(z, a, cal.temperatures) < confidence_nll(z, a, (1.0,) * 4) - 0.2
    assert all(after < before for before, after in zip(cal.ece_before, cal.ece_after))
    assert max(cal.ece_after) < 0.02 and min(cal.ece_before) > 0.04
    assert cal.num_samples == len(a) and cal.dataset == "synthetic"
    assert cal.ece_after == pytest.approx(prefix_ece(z, a, cal.temperatures))


def _biased(n=40_000, seed=0):
    """Rounds whose head is biased: true c_k = σ(t_k) with t_k ~ N(-0.5, 1.5²), the head reports
    z_k = s_k · t_k + 1.5 (mean z > 0 while most drafts are rejected: no temperature fixes that)."""
    g = torch.Generator().manual_seed(seed)
    t = -0.5 + 1.5 * torch.randn(n, len(SCALES), generator=g, dtype=torch.float64)
    accepted = torch.rand(n, len(SCALES), generator=g, dtype=torch.float64) < torch.sigmoid(t)
    return (t * torch.tensor(SCALES, dtype=torch.float64) + 1.5).float(), accepted.long().cumprod(1).sum(1)


def test_affine_fit_recovers_temperature_and_bias_where_a_temperature_alone_cannot():
    z, a = _biased()
    cal = fit_sts(z, a, objective="affine", sampling_temperature=1.0)
    for k, (t, b) in enumerate(zip(cal.temperatures, cal.biases)):
        # z = s·t + 1.5  =>  t = z / s − 1.5 / s: T = s, b = −1.5 / s
        assert t == pytest.approx(SCALES[k], rel=0.1) and b == pytest.approx(-1.5 / SCALES[k], rel=0.1, abs=0.1)
    nll_only = fit_sts(z, a, objective="nll")
    assert confidence_nll(z, a, cal.temperatures, cal.biases) < confidence_nll(z, a, nll_only.temperatures) - 0.05
    assert max(cal.ece_after) < 0.02 < min(prefix_ece(z, a, nll_only.temperatures))
    # the first position's mean confidence matches its acceptance rate; temperature alone stays above 1/2
    rate = (a > 0).double().mean()
    assert float(cal.apply(z)[:, 0].double().mean()) == pytest.approx(float(rate), abs=0.01)
    assert float(nll_only.apply(z)[:, 0].double().mean()) > 0.5 > float(rate) + 0.05
    assert cal.sampling_temperature == 1.0 and cal.objective == "affine"


def test_acceptance_is_the_conditional_rate_whose_product_is_the_mean_survival():
    z, a = _biased(n=5000, seed=3)
    cal = fit_sts(z, a)
    survival = torch.tensor(cal.acceptance, dtype=torch.float64).cumprod(0)
    for k in range(len(SCALES)):
        assert float(survival[k]) == pytest.approx(float((a > k).double().mean()), abs=1e-12)


def test_affine_apply_and_round_trip(tmp_path):
    cal = StsCalibration((2.0, 0.5), "affine", biases=(-1.0, 0.25), sampling_temperature=0.0, acceptance=(0.6, 0.7))
    z = torch.tensor([[1.0, -1.0], [3.0, 0.5]])
    torch.testing.assert_close(cal.apply(z), torch.sigmoid(z / torch.tensor([2.0, 0.5]) + torch.tensor([-1.0, 0.25])))
    cal.save(tmp_path / "sts.json")
    assert StsCalibration.load(tmp_path / "sts.json") == cal
    assert StsCalibration((1.0, 1.0)).offsets == (0.0, 0.0)


def test_ece_objective_lowers_prefix_ece():
    z, a = _synthetic(seed=1)
    cal = fit_sts(z, a, objective="ece")
    assert all(after < before for before, after in zip(cal.ece_before, cal.ece_after))
    assert max(cal.ece_after) < 0.02
    assert all(0.1 <= t <= 10 for t in cal.temperatures)


def test_apply_preserves_order_and_scales_logits():
    cal = StsCalibration((2.0, 0.5))
    z = torch.tensor([[1.0, -1.0], [3.0, 0.5], [-2.0, 2.0]])
    c = cal.apply(z)
    torch.testing.assert_close(c, torch.sigmoid(z / torch.tensor([2.0, 0.5])))
    for k in range(2):  # order-preserving per position: AUROC unchanged
        assert torch.equal(torch.argsort(c[:, k]), torch.argsort(z[:, k]))
    with pytest.raises(ValueError, match="γ=2"):
        cal.apply(torch.zeros(4, 3))


def test_apply_first_calibrates_the_leading_positions_of_a_shorter_block():
    cal = StsCalibration((2.0, 0.5, 4.0))
    z = torch.tensor([[1.0, -1.0, 0.3], [3.0, 0.5, -2.0]])
    for k in (1, 2, 3):
        torch.testing.assert_close(cal.apply_first(z[:, :k]), cal.apply(z)[:, :k])
    for width in (0, 4):
        with pytest.raises(ValueError, match=rf"1 <= k <= γ=3, got torch.float32 \(2, {width}\)"):
            cal.apply_first(torch.zeros(2, width))


def test_position_without_data_keeps_identity():
    z = torch.randn(50, 3)
    a = torch.zeros(50, dtype=torch.long)  # nothing ever accepted: positions 1, 2 are never judged
    cal = fit_sts(z, a)
    assert cal.temperatures[1:] == (1.0, 1.0)


def test_json_round_trip_and_gamma_check(tmp_path):
    z, a = _synthetic(n=2000)
    cal = fit_sts(z, a, dataset="synthetic-2k")
    path = tmp_path / "sts.json"
    cal.save(path)
    loaded = StsCalibration.load(path, gamma=4)
    assert loaded == cal
    torch.testing.assert_close(loaded.apply(z), cal.apply(z))
    with pytest.raises(ValueError, match="refit"):
        StsCalibration.load(path, gamma=5)
    with pytest.raises(ValueError, match="format"):
        StsCalibration.from_dict({"temperatures": [1.0]})


@pytest.mark.parametrize("kwargs, match", [
    ({"temperatures": ()}, "temperatures"),
    ({"temperatures": (1.0, 0.0)}, "temperatures"),
    ({"temperatures": (1.0, float("nan"))}, "temperatures"),
    ({"temperatures": (1.0,), "objective": "mse"}, "objective"),
    ({"temperatures": (1.0,), "ece_before": (0.1, 0.2)}, "ece_before"),
    ({"temperatures": (1.0,), "biases": (float("inf"),)}, "biases"),
    ({"temperatures": (1.0,), "biases": (0.0, 1.0)}, "biases"),
    ({"temperatures": (1.0,), "sampling_temperature": -1.0}, "sampling_temperature"),
    ({"temperatures": (1.0,), "acceptance": (1.5,)}, "acceptance"),
])
def test_invalid_calibrations_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StsCalibration(**kwargs)


def test_fit_input_validation():
    with pytest.raises(ValueError, match="objective"):
        fit_sts(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), objective="brier")
    with pytest.raises(ValueError, match="num_accepted"):
        fit_sts(torch.zeros(4, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="finite"):
        fit_sts(torch.full((4, 2), float("inf")), torch.zeros(4, dtype=torch.long))
