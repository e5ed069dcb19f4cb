"""Verification budget and throughput against concurrency (DSpark Fig. 7–8), from engine traces.

Records are grouped into engine rounds by their `step` field (`traces.number_steps`). A round of
load R verifies B = Σ_r (1 + ℓ_r) tokens in one target call; its duration is modelled as the
capacity table's step time 1/SPS(B) (`dspark.verify.capacity`), so the numbers are what that
deployment would achieve with the recorded acceptance. Drafting and prefill time are not in the
table and therefore not in these numbers: compare configurations under the same table, and
profile the table on the deployment before quoting throughput.

Shape symbols: N rounds (records), S engine steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dspark.analysis.traces import to_arrays
from dspark.verify.capacity import CapacityTable


def step_table(trace) -> dict[str, np.ndarray]:
    """Per engine step (int64 [S] each, in step order): step, load (requests), batch_tokens
    (Σ 1 + ℓ), verified (Σ ℓ), committed (Σ committed tokens)."""
    t = to_arrays(trace)
    if t.num_rounds == 0:
        raise ValueError("the trace holds no rounds")
    if (t.step < 0).any():
        raise ValueError("records lack the `step` field; number them with dspark.analysis.number_steps")
    steps, inverse = np.unique(t.step, return_inverse=True)
    size = np.bincount(inverse)

    def total(x):
        return np.bincount(inverse, weights=x).astype(np.int64)

    mismatch = t.load != size[inverse]                              # [N] record vs its step's size
    if mismatch.any():
        bad = int(t.step[np.flatnonzero(mismatch)[0]])
        raise ValueError(f"step {bad}: its record count disagrees with the `load` field (filtered trace?)")
    return {"step": steps.astype(np.int64), "load": size.astype(np.int64),
            "batch_tokens": total(t.verified + 1), "verified": total(t.verified),
            "committed": total(t.committed)}


def load_table(trace, capacity: CapacityTable) -> list[dict]:
    """One row per observed load (concurrency) R, ascending.

    Keys: load, steps; verify_tokens (mean 1 + ℓ per request, the Fig. 8 budget) and drafts_verified
    (mean ℓ); tau (committed tokens per request per step); batch_tokens (mean B); step_time_s (mean
    modelled step time, s); throughput (Σ committed / Σ step time, tokens/s over all requests);
    per_user (throughput / R, tokens/s seen by one request).
    """
    s = step_table(trace)
    seconds = 1.0 / capacity.many(s["batch_tokens"])                # [S]
    rows = []
    for load in np.unique(s["load"]).tolist():
        m = s["load"] == load
        requests = load * int(m.sum())                              # request-steps at this load
        throughput = float(s["committed"][m].sum() / seconds[m].sum())
        rows.append({
            "load": int(load), "steps": int(m.sum()),
            "verify_tokens": float(s["batch_tokens"][m].sum() / requests),
            "drafts_verified": float(s["verified"][m].sum() / requests),
            "tau": float(s["committed"][m].sum() / requests),
            "batch_tokens": float(s["batch_tokens"][m].mean()), "step_time_s": float(seconds[m].mean()),
            "throughput": throughput, "per_user": throughput / load,
        })
    return rows


def frontier(rows: Sequence[dict]) -> list[dict]:
    """Throughput–interactivity points (per_user, throughput) sorted by per_user, each with `pareto`:
    True when no other point is at least as good on both axes and better on one."""
    points = sorted(rows, key=lambda r: (r["per_user"], r["throughput"]))
    out = []
    for r in points:
        dominated = any(o["per_user"] >= r["per_user"] and o["throughput"] >= r["throughput"]
                        and (o["per_user"] > r["per_user"] or o["throughput"] > r["throughput"]) for o in rows)
        out.append({**r, "pareto": not dominated})
    return out
