"""Confidence calibration: does cumprod(c) predict which draft prefixes survive? (spec §4.4, §6)

For round n and draft slot k the prediction is the prefix survival a_{n,k} = Π_{i≤k} c_{n,i} and
the label is y_{n,k} = 1[A_n > k]. A label exists only where slot k was verified (ℓ_n > k): on a
truncated (planner) trace the unverified slots are censored and are left out, which favours
confident rounds, so calibrate and report on verify-all traces (budget = γ).

Reused from `dspark.verify.sts`: the ECE (20 equal-width bins, |Σ pred − Σ label| / N per bin) and
the STS fit. Scaling by STS temperatures keeps each position's order, so AUROC does not move.

Shape symbols: N rounds, γ block size, M judged (round, slot) pairs of one position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.analysis.traces import TraceArrays, to_arrays
from dspark.verify.sts import StsCalibration, expected_calibration_error, fit_sts

_EPS = 1e-6  # keeps logit(c) finite for drafters that report c in {0, 1}


@dataclass(frozen=True)
class Reliability:
    """Reliability-diagram data for one position.

    edges : float64 [num_bins + 1], bin boundaries on the predicted survival
    mean_pred, mean_label : float64 [num_bins], NaN for empty bins
    count : int64 [num_bins]
    """

    edges: np.ndarray
    mean_pred: np.ndarray
    mean_label: np.ndarray
    count: np.ndarray


def confidence_logits(trace) -> np.ndarray:
    """Raw confidence logits z: float64 [N, γ]. The recorded head logits when every round has them,
    else logit(c) of the recorded confidences (what σ(z / 1) maps back to c)."""
    t = to_arrays(trace)
    if t.confidence_logits is not None:
        return t.confidence_logits
    if np.isnan(t.confidence).any():
        raise ValueError("some rounds carry no confidences (plain decoding?); nothing to calibrate")
    c = np.clip(t.confidence, _EPS, 1 - _EPS)
    return np.log(c) - np.log1p(-c)


def survival_and_labels(trace, calibration: StsCalibration | None = None):
    """(pred float64 [N, γ], label float64 [N, γ], judged bool [N, γ]).

    pred = cumprod(c) with c the recorded confidences, or σ(z_k / T_k) under `calibration`.
    """
    t = to_arrays(trace)
    if calibration is None:
        if np.isnan(t.confidence).any():
            raise ValueError("some rounds carry no confidences (plain decoding?); nothing to calibrate")
        c = t.confidence
    else:
        if calibration.gamma != t.gamma:
            raise ValueError(f"calibration has γ={calibration.gamma}, trace has γ={t.gamma}")
        c = calibration.apply(torch.from_numpy(confidence_logits(t))).numpy()
    k = np.arange(t.gamma)[None, :]
    label = (t.accepted[:, None] > k).astype(np.float64)
    judged = t.verified[:, None] > k
    return np.cumprod(c, axis=1), label, judged


def ece(pred: np.ndarray, label: np.ndarray, num_bins: int = 20) -> float:
    """Expected calibration error of pred [M] in [0, 1] against label [M] in {0, 1}."""
    return expected_calibration_error(torch.as_tensor(np.asarray(pred, np.float64)),
                                      torch.as_tensor(np.asarray(label, np.float64)), num_bins)


def auroc(pred: np.ndarray, label: np.ndarray) -> float:
    """Area under the ROC curve: P(pred of a positive > pred of a negative), ties counting ½.

    Exact (Mann–Whitney with mid-ranks). Shapes: pred, label [M]. NaN unless both classes occur.
    """
    pred, label = np.asarray(pred, np.float64), np.asarray(label).astype(bool)
    if pred.shape != label.shape or pred.ndim != 1:
        raise ValueError(f"pred and label must both be [M], got {pred.shape} and {label.shape}")
    pos, neg = int(label.sum()), int((~label).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    values, inverse, counts = np.unique(pred, return_inverse=True, return_counts=True)
    first_rank = np.cumsum(counts) - counts + 1            # 1-based rank of each distinct value
    ranks = (first_rank + (counts - 1) / 2.0)[inverse]     # mid-rank for ties
    return float((ranks[label].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def reliability(pred: np.ndarray, label: np.ndarray, num_bins: int = 20) -> Reliability:
    """Per-bin mean prediction and observed frequency, binned as in the ECE."""
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be an int >= 1, got {num_bins!r}")
    pred, label = np.asarray(pred, np.float64), np.asarray(label, np.float64)
    bins = np.clip((pred * num_bins).astype(np.int64), 0, num_bins - 1)
    count = np.bincount(bins, minlength=num_bins)
    with np.errstate(invalid="ignore"):
        mean_pred = np.bincount(bins, weights=pred, minlength=num_bins) / np.where(count, count, np.nan)
        mean_label = np.bincount(bins, weights=label, minlength=num_bins) / np.where(count, count, np.nan)
    return Reliability(np.linspace(0.0, 1.0, num_bins + 1), mean_pred, mean_label, count.astype(np.int64))


def calibration_table(trace, calibration: StsCalibration | None = None, num_bins: int = 20) -> list[dict]:
    """Per draft slot k: judged rounds, mean predicted survival, observed survival, ECE, AUROC, Brier.

    With `calibration` the predictions are the STS-scaled ones (raw logits divided by T_k).
    """
    pred, label, judged = survival_and_labels(trace, calibration)
    rows = []
    for k in range(pred.shape[1]):
        p, y = pred[judged[:, k], k], label[judged[:, k], k]     # [M]
        rows.append({
            "position": k, "rounds": int(p.size),
            "mean_pred": float(p.mean()) if p.size else float("nan"),
            "observed": float(y.mean()) if y.size else float("nan"),
            "ece": ece(p, y, num_bins), "auroc": auroc(p, y),
            "brier": float(((p - y) ** 2).mean()) if p.size else float("nan"),
        })
    return rows


def verify_all_rounds(trace) -> TraceArrays:
    """The rounds that verified their whole block (ℓ = γ): the uncensored ones STS needs."""
    t = to_arrays(trace)
    return t.select(t.verified == t.gamma)


def holdout_split(trace, folds: int = 2) -> tuple[TraceArrays, TraceArrays]:
    """(fit, held_out): request i (first-seen order) is held out when i % folds == folds − 1.

    Splitting by request, not by round, keeps the rounds of one completion (which are correlated)
    on one side, so held-out ECE is not flattered by near-duplicates of the fitting rounds.
    """
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise ValueError(f"folds must be an int >= 2, got {folds!r}")
    t = to_arrays(trace)
    order = {rid: i for i, rid in enumerate(dict.fromkeys(t.request_id.tolist()))}
    held = np.array([order[r] % folds == folds - 1 for r in t.request_id.tolist()], dtype=bool).reshape(-1)
    return t.select(~held), t.select(held)


def fit_sts_from_trace(trace, objective: str = "nll", dataset: str = "", num_bins: int = 20) -> StsCalibration:
    """STS temperatures fitted on the verify-all rounds of `trace` (`dspark.verify.sts.fit_sts`).

    ValueError when no round verified its whole block.
    """
    t = verify_all_rounds(trace)
    if t.num_rounds == 0 or t.gamma == 0:
        raise ValueError("no verify-all rounds (ℓ = γ) in the trace; record one with budget = γ")
    return fit_sts(torch.from_numpy(confidence_logits(t)), torch.from_numpy(t.accepted), objective=objective,
                   dataset=dataset, num_bins=num_bins)


def reliability_by_position(trace, calibration: StsCalibration | None = None,
                            num_bins: int = 20) -> list[Reliability]:
    """`reliability` of every draft slot k over its judged rounds (list of γ diagrams)."""
    pred, label, judged = survival_and_labels(trace, calibration)
    return [reliability(pred[judged[:, k], k], label[judged[:, k], k], num_bins) for k in range(pred.shape[1])]
