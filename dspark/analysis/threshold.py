"""Static confidence-threshold sweep (DSpark Fig. 5), replayed from verify-all traces.

A threshold t truncates each round's block at the first draft whose score falls below t, so the
round verifies L(t) = #leading drafts with score ≥ t. Acceptance is a prefix property decided left
to right, so the truncated round accepts min(A, L) of the drafts the full round accepted (for
rejection sampling too: fixing the cap before sampling leaves the decisions before it unchanged,
spec §4.3 "cap-accept"). Its committed tokens are min(committed, min(A, L) + 1): the bonus or
correction after the cap, unless an accepted stop token ended the round earlier.

The replay is only valid on traces whose rounds verified every draft they could (budget = γ): a
round a planner already cut gives a censored A. Rounds cut by the length limit are replayed with
L = min(L(t), ℓ), as the live engine would have cut them too.

Shape symbols: N rounds, γ block size, S thresholds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dspark.analysis.traces import to_arrays

CRITERIA = ("confidence", "survival")


def truncation_lengths(scores: np.ndarray, threshold: float) -> np.ndarray:
    """Leading drafts with score ≥ threshold. Shapes: scores float [N, γ] -> int64 [N]."""
    keep = np.cumprod(np.asarray(scores) >= threshold, axis=1)   # [N, γ], 1 until the first miss
    return keep.sum(axis=1).astype(np.int64)


def threshold_sweep(trace, thresholds: Sequence[float], criterion: str = "confidence") -> list[dict]:
    """Tokens per round and acceptance rate when truncating at each threshold.

    Parameters
    ----------
    trace : records or TraceArrays of verify-all rounds (module docstring)
    thresholds : S values; a finite float each
    criterion : "confidence" truncates at the first c_k < t (Fig. 5); "survival" at the first
        cumprod(c)_k < t (what a survival-based planner would do)

    Returns
    -------
    list of S dicts: threshold, verified (mean ℓ per round), accepted and rejected (mean drafts per
    round), tokens (mean committed per round, τ), acceptance_rate (Σ accepted / Σ verified, NaN if
    nothing is verified), verify_rate (Σ (ℓ + 1) / Σ (γ + 1)).
    """
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
    t = to_arrays(trace)
    if t.num_rounds == 0 or t.gamma == 0:
        raise ValueError("the trace holds no drafted rounds")
    if np.isnan(t.confidence).any():
        raise ValueError("some rounds carry no confidences; a threshold sweep needs them")
    scores = t.confidence if criterion == "confidence" else np.cumprod(t.confidence, axis=1)
    rows = []
    for threshold in thresholds:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ValueError(f"thresholds must be finite numbers, got {threshold!r}")
        length = np.minimum(truncation_lengths(scores, threshold), t.verified)   # [N]
        accepted = np.minimum(t.accepted, length)
        tokens = np.minimum(t.committed, accepted + 1)
        rows.append({
            "threshold": float(threshold), "verified": float(length.mean()), "accepted": float(accepted.mean()),
            "rejected": float((length - accepted).mean()), "tokens": float(tokens.mean()),
            "acceptance_rate": float(accepted.sum() / length.sum()) if length.sum() else float("nan"),
            "verify_rate": float((length + 1).sum() / ((t.gamma + 1) * t.num_rounds)),
        })
    return rows
