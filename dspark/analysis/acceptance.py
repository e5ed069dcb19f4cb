"""Acceptance statistics of speculative rounds (dspark spec §6, peers §4.2).

Positions are 0-indexed draft slots: index k is the paper's position k + 1 (the (k+1)-th drafted
token after the anchor). All functions take a list of trace records or a `TraceArrays`.

* τ (accepted length) = mean over rounds of the tokens the round committed: accepted drafts + the
  target's bonus/correction token; a round that ends on an accepted stop token counts only the
  drafts up to that token (the `committed` field already follows this rule).
* accept_rate@k (unconditional prefix survival, DeepSpec) = #(A ≥ k+1) / #(ℓ ≥ k+1).
* conditional acceptance at k (DSpark Fig. 2) = #(A ≥ k+1) / #(A ≥ k and ℓ ≥ k+1): draft k judged
  on its own, among rounds whose earlier drafts all survived and that verified it.
* verify_rate = Σ (ℓ + 1) / Σ (γ + 1): verified share of the proposed block (anchor included).
* acceptance rate = Σ A / Σ ℓ: accepted share of the verified drafts.

Ratios with an empty denominator are NaN rather than an exception: a position nobody reached is
data, not an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dspark.analysis.traces import TraceArrays, to_arrays

# Which evaluation sets belong to which of the paper's domains (Table 1 column groups).
CATEGORIES = {
    "gsm8k": "math", "math500": "math", "aime25": "math",
    "humaneval": "code", "mbpp": "code", "livecodebench": "code",
    "mt-bench": "chat", "alpaca": "chat", "arena-hard-v2": "chat",
}


def _ratio(num, den) -> np.ndarray:
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _nonempty(trace) -> TraceArrays:
    t = to_arrays(trace)
    if t.num_rounds == 0:
        raise ValueError("the trace holds no rounds")
    return t


def tau(trace) -> float:
    """Mean committed tokens per round (bonus included), over all rounds of `trace`."""
    return float(_nonempty(trace).committed.mean())


def tau_histogram(trace) -> np.ndarray:
    """Rounds committing j tokens, for j = 0 .. γ+1: int64 [γ + 2] (entry 0 is always 0)."""
    t = _nonempty(trace)
    return np.bincount(t.committed, minlength=t.gamma + 2).astype(np.int64)


def accept_histogram(trace) -> np.ndarray:
    """Rounds that accepted j drafts, for j = 0 .. γ: int64 [γ + 1]."""
    t = _nonempty(trace)
    return np.bincount(t.accepted, minlength=t.gamma + 1).astype(np.int64)


def tau_per_request(trace) -> dict[str, float]:
    """τ of each request (its committed tokens / its rounds), in first-seen order.

    A per-request mean weights every prompt equally; the pooled `tau` weights long completions more.
    """
    t = _nonempty(trace)
    ids, inverse = np.unique(t.request_id, return_inverse=True)
    sums = np.bincount(inverse, weights=t.committed)
    counts = np.bincount(inverse)
    by_id = {rid: float(s / c) for rid, s, c in zip(ids.tolist(), sums, counts)}
    return {rid: by_id[rid] for rid in dict.fromkeys(t.request_id.tolist())}


def position_counts(trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per draft slot k (int64 [γ] each): verified (ℓ ≥ k+1), reached (A ≥ k and ℓ ≥ k+1),
    accepted (A ≥ k+1)."""
    t = _nonempty(trace)
    k = np.arange(t.gamma)[None, :]                         # [1, γ]
    verified = t.verified[:, None] >= k + 1                  # [N, γ]
    reached = (t.accepted[:, None] >= k) & verified
    accepted = t.accepted[:, None] >= k + 1
    return verified.sum(0), reached.sum(0), accepted.sum(0)


def prefix_survival(trace) -> np.ndarray:
    """accept_rate@k = P(drafts 0..k all accepted | draft k verified): float64 [γ], NaN if unverified."""
    verified, _, accepted = position_counts(trace)
    return _ratio(accepted, verified)


def conditional_acceptance(trace) -> np.ndarray:
    """P(draft k accepted | drafts 0..k-1 accepted, draft k verified): float64 [γ], NaN if never reached."""
    _, reached, accepted = position_counts(trace)
    return _ratio(accepted, reached)


def verify_rate(trace) -> float:
    """Σ (ℓ + 1) / Σ (γ + 1): 1.0 when every round verifies its whole block."""
    t = _nonempty(trace)
    return float((t.verified + 1).sum() / ((t.gamma + 1) * t.num_rounds))


def acceptance_rate(trace) -> float:
    """Σ accepted / Σ verified drafts; NaN when no draft was verified (plain decoding)."""
    t = _nonempty(trace)
    return float(_ratio(t.accepted.sum(), t.verified.sum()))


def summary_row(trace) -> dict:
    """Every statistic above for one set of rounds, as JSON-friendly Python values."""
    t = _nonempty(trace)
    per_request = tau_per_request(t)
    return {
        "requests": len(per_request), "rounds": t.num_rounds, "tokens": int(t.committed.sum()),
        "tau": tau(t), "tau_request_mean": float(np.mean(list(per_request.values()))),
        "acceptance_rate": acceptance_rate(t), "verify_rate": verify_rate(t),
        "mean_verified": float(t.verified.mean()), "bonus_rate": float(t.bonus.mean()),
        "accept_rate_at_k": prefix_survival(t).tolist(), "conditional": conditional_acceptance(t).tolist(),
        "accept_hist": accept_histogram(t).tolist(), "tau_hist": tau_histogram(t).tolist(),
    }


def domain_table(trace, domains: Sequence[str] | None = None) -> list[dict]:
    """One `summary_row` per domain (the trace's `domain` field), each with `domain` and `category`.

    `domains` picks and orders them (default: first-seen order); a requested domain without rounds
    raises ValueError.
    """
    t = _nonempty(trace)
    present = t.domains()
    for d in domains or ():
        if d not in present:
            raise ValueError(f"domain {d!r} has no rounds in the trace; present: {present}")
    return [{"domain": d, "category": CATEGORIES.get(d, d), **summary_row(t.select(t.domain == d))}
            for d in (domains or present)]


def category_means(rows: Sequence[dict], key: str = "tau") -> dict[str, float]:
    """Macro mean of `key` over the domains of each category, e.g. {"math": 5.57, ...} (paper §10.1),
    plus "all": the macro mean over domains."""
    groups: dict[str, list[float]] = {}
    for row in rows:
        groups.setdefault(row["category"], []).append(row[key])
    out = {c: float(np.mean(v)) for c, v in groups.items()}
    if rows:
        out["all"] = float(np.mean([row[key] for row in rows]))
    return out
