"""How many drafts each request verifies this round: fixed budget, Algorithm 1, asynchronous top-K,
asynchronous uniform budget.

Every planner returns a `VerifyPlan`: ℓ_r drafts for request r, i.e. a verify width of ℓ_r + 1
tokens (its anchor plus the first ℓ_r drafts of its γ-block). Everything here is host-side and
model-free: confidences come in as CPU tensors or lists (moving a device tensor to the host is the
caller's sync point, and the asynchronous planner exists precisely to take it off the critical
path).

Inputs. `confidence[r, k]` = c_{r,k}, the drafter's estimate that draft x_{r,k} (0-indexed slot k)
survives verification given x_{r,<k} did. Survival a_{r,k} = Π_{i<=k} c_{r,i}, non-increasing in k.
`max_lens[r]` (optional) caps ℓ_r, e.g. near a request's token limit.

Objective (paper §3.2.2, spec §4.1). With batch tokens B = Σ_r (1 + ℓ_r) and expected committed
tokens τ = Σ_r (1 + Σ_{k<ℓ_r} a_{r,k}), maximise the throughput Θ = τ · SPS(B), SPS from a
`CapacityTable`.

Why truncating a block to a prefix stays lossless (spec §3.4). Rejection sampling reproduces the
target at every admitted position whatever the drafts were, *provided that the event "x_{r,k} is
admitted" is fixed before x_{r,k} is sampled*: it may depend on the context, on x_{r,<k}, on other
requests and on c_{r,<=k} (c_{r,k} is computed from x_{r,k-1}, never from x_{r,k}), but not on
x_{r,k} or anything computed from it. A rule that peeks at c_{r,k+1} (which reads x_{r,k} through the
Markov embedding) or at the target's verdict is *retrospective*: it admits x_{r,k} preferentially
when x_{r,k} is a "good" token, which reweights the emitted distribution towards those tokens. The
paper's Appendix A: γ = 2, target (0.7, 0.3), draft (0.5, 0.5), SPS(1, 2, 3) = (1, 0.5, 0.45),
a_1 = 0.8, c_2 = 1 after token A and 0 after B; a global search over all lengths admits the block only
when x_1 = A and emits A with probability 0.85 instead of 0.7 (reproduced exactly in
tests/verify/test_planner.py). The planners below are non-anticipating:

* `plan_fixed`: ℓ_r = min(n, γ, max_len_r) depends on nothing drafted.
* `plan_algorithm1`: candidates are walked in descending survival (ties: position, then request),
  and the walk stops at the first step that does not improve Θ. Whether (r, k) is admitted depends
  only on the candidates ranked at or above it; (r, k + 1) always ranks below (r, k) because
  a_{r,k+1} <= a_{r,k} with position-first tie-breaking, so x_{r,k}'s continuation cannot influence
  its own admission. The early stop is what makes it exact; without it, the argmax over the whole
  path would look at later candidates (Appendix A).
* `plan_async`: the total budget K is an unconstrained argmax, but over confidences at least two
  steps old (which predate every current draft); the current confidences only rank candidates, and
  (r, k) is admitted iff fewer than K candidates rank strictly above it, again a set that never
  contains (r, k + 1). This is the production scheme (paper §5.2, spec §4.3). The engine's dynamic
  round computes K before drafting (`async_budget`) and drafts nothing when K = 0.
* `uniform_budget`: one budget n for every request, an unconstrained argmax over the same stale
  confidences; nothing current is read, so it is `plan_fixed` with an n chosen beforehand (the
  engine's round in flight, which cannot read the current confidences at all). With `min_budget=0`
  the argmax includes n = 0, plain decoding, which drafts nothing and so decides nothing about drafts.

Shape symbols: R requests, γ block size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark.verify.capacity import CapacityTable

Confidence = torch.Tensor | Sequence[Sequence[float]]


@dataclass(frozen=True)
class VerifyPlan:
    """Per-request verify lengths for one round.

    draft_lens : tuple[int, ...] of length R
        ℓ_r, the number of leading drafts request r sends to the target (0..γ).
    """

    draft_lens: tuple[int, ...]

    def __post_init__(self):
        lens = tuple(int(n) for n in self.draft_lens)
        if any(n < 0 for n in lens):
            raise ValueError(f"draft_lens must be >= 0, got {lens}")
        object.__setattr__(self, "draft_lens", lens)

    @property
    def verify_lens(self) -> tuple[int, ...]:
        """Target rows per request: anchor + ℓ_r drafts."""
        return tuple(n + 1 for n in self.draft_lens)

    @property
    def batch_tokens(self) -> int:
        """B = Σ_r (1 + ℓ_r), the target forward's token count."""
        return sum(self.draft_lens) + len(self.draft_lens)

    @property
    def num_drafts(self) -> int:
        """Σ_r ℓ_r, drafts sent to verification."""
        return sum(self.draft_lens)


def survival(confidence: Confidence) -> torch.Tensor:
    """Prefix survival a = cumprod(c) along the block.

    Parameters
    ----------
    confidence : float tensor or nested sequence [R, γ], values in [0, 1]

    Returns
    -------
    a : float64 CPU tensor [R, γ], non-increasing along dim 1
    """
    c = _confidence(confidence)
    return torch.cumprod(c, dim=1)


def expected_tokens(confidence: Confidence, plan: VerifyPlan) -> float:
    """τ = Σ_r (1 + Σ_{k<ℓ_r} a_{r,k}): expected committed tokens of the round, bonus included."""
    a = survival(confidence)
    _check_plan(plan, a.shape)
    keep = torch.arange(a.shape[1])[None, :] < torch.tensor(plan.draft_lens)[:, None]
    return float(a.shape[0] + (a * keep).sum())


def throughput(confidence: Confidence, plan: VerifyPlan, capacity: CapacityTable) -> float:
    """Θ = τ · SPS(B): expected committed tokens per second for `plan`."""
    return expected_tokens(confidence, plan) * capacity(plan.batch_tokens)


def plan_fixed(draft_tokens: int, gamma: int, num_requests: int,
               max_lens: Sequence[int] | None = None) -> VerifyPlan:
    """Fixed verification budget: every request verifies its first min(draft_tokens, γ) drafts.

    `draft_tokens = 0` is plain decoding (verify the anchor only, spec §11.12). This is what
    `dspark.generate(..., draft_tokens=n)` means: a budget that truncates the γ-block, never a
    shorter block (peers §0.3).
    """
    for name, v in (("draft_tokens", draft_tokens), ("gamma", gamma), ("num_requests", num_requests)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    caps = _max_lens(max_lens, num_requests, gamma)
    n = min(draft_tokens, gamma)
    return VerifyPlan(tuple(min(n, c) for c in caps))


def plan_algorithm1(confidence: Confidence, capacity: CapacityTable,
                    max_lens: Sequence[int] | None = None) -> VerifyPlan:
    """Synchronous confidence-scheduled verification (paper Algorithm 1, spec §4.2), lossless.

    Walk the candidates (r, k) with a_{r,k} > 0 in descending survival, ties broken by position then
    request; adding one raises B by 1 and τ by a_{r,k}. Keep walking while Θ = τ · SPS(B) strictly
    improves on the best so far (starting from Θ = R · SPS(R), nothing admitted) and stop at the first
    step that does not: the early stop is required for losslessness (module docstring), and it finds
    the global optimum whenever Θ is unimodal along the walk (smooth SPS).

    Parameters
    ----------
    confidence : float tensor or nested sequence [R, γ], values in [0, 1]
    capacity : CapacityTable
    max_lens : sequence of R ints in [0, γ], optional; candidates beyond are not considered

    Returns
    -------
    VerifyPlan
    """
    a = survival(confidence)
    rows, gamma = a.shape
    order, values = _ranked_candidates(a, _max_lens(max_lens, rows, gamma))
    if rows == 0:
        return VerifyPlan(())
    tau = rows + np.concatenate([[0.0], np.cumsum(values)])  # [N+1] τ after b admissions
    theta = tau * capacity.many(rows + np.arange(len(tau)))  # [N+1]
    improving = theta[1:] > theta[:-1]  # after b commits the best so far is theta[b]
    stop = int(np.argmin(improving)) if not improving.all() else len(improving)
    return _plan_from(order[:stop], rows, gamma)


def async_budget(stale_confidence: Sequence[Sequence[float] | torch.Tensor | None], gamma: int,
                 capacity: CapacityTable, max_lens: Sequence[int] | None = None, min_budget: int = 0) -> int:
    """Total extra verify tokens K for the current step, from confidences >= 2 steps old (spec §4.3).

    Row r holds request r's confidences from two steps earlier, or None when there are none for it
    (new request, reassigned slot); such rows are taken as survival 1 at every position, so new
    requests are not starved. With S_b the sum of the b largest stale survivals (> 0),
    K = argmax_b (R + S_b) · SPS(R + b) over b = M..N (M = `min_budget`, 0 or 1), the smallest b on
    ties. b = 0 is priced as a plain step of R requests, `capacity.plain(R)` (SPS(R) for a table
    without a plain curve): K is fixed before the round drafts (`dspark.round`), and K = 0 drafts
    nothing, so a table whose main curve includes the drafting (`dspark profile --drafter`) weighs
    drafting against plain decoding. The search is unconstrained (no early stop): that is allowed only
    because none of its inputs can depend on a token drafted in the current step.

    Shapes: stale_confidence R rows of [γ] (or None); returns an int in [M, R·γ] (0 when there is no
    candidate).
    """
    if min_budget not in (0, 1) or isinstance(min_budget, bool):
        raise ValueError(f"min_budget must be 0 or 1, got {min_budget!r}")
    a = _stale_survival(stale_confidence, gamma)
    rows = a.shape[0]
    if rows == 0:
        return 0
    _, values = _ranked_candidates(a, _max_lens(max_lens, rows, gamma))
    tau = rows + np.concatenate([[0.0], np.cumsum(values)])
    theta = tau * capacity.many(rows + np.arange(len(tau)))
    theta[0] = rows * capacity.plain(rows)
    if min_budget and len(theta) > 1:
        theta[0] = -np.inf
    return int(np.argmax(theta))  # first maximum: the smallest budget among ties


def uniform_budget(stale_confidence: Sequence[Sequence[float] | torch.Tensor | None], gamma: int,
                   capacity: CapacityTable, max_budget: int | None = None, min_budget: int = 1) -> int:
    """One verification budget n for every request of a round launched before the previous round is
    read, from confidences >= 2 rounds old (the engine's round in flight, `dspark.engine.draft_lookahead`).

    Rule. Stale survivals a_{r,k} as in `async_budget` (a row None: survival 1 at every position). Among
    the uniform plans ℓ_r = n for all R requests, B = R·(1 + n) and τ(n) = R + Σ_r Σ_{k<n} a_{r,k}, so

        n* = argmax_{M <= n <= N} τ(n) · SPS(R·(1 + n)),    M = min_budget (default 1),
                                                              N = max_budget (default γ),

    the smallest n on ties. It is `async_budget`'s objective restricted to uniform plans, and it is
    non-anticipating for the same reason: nothing it reads was computed from a draft of the round it
    sizes, so the round verifies a budget fixed beforehand, exactly like `plan_fixed`.

    n = 0 (`min_budget=0`) is plain decoding: τ(0) = R tokens at `capacity.plain(R)`, a plain step
    of R requests (no propose): the table's plain curve where it has one (`dspark profile` measures
    it), else its entry at B = R (`CapacityTable` says which tables price that right). Where that beats every drafting budget, e.g. a large batch whose step is compute-bound, the
    round skips drafting; ties go to it, as to any smaller budget. The default floor of 1 keeps a
    caller that always drafts (and cannot run a plain step) on budgets 1..N.

    Why uniform, and not K / R from `async_budget`. The static decode step verifies [b slots, 1 + n]
    rows, one CUDA graph per width, and the round in flight is launched from the previous round's
    device results with no host read: its width must be known on the host, and picking each request's
    ℓ_r from the *current* confidences (what `select_top_k` does after `async_budget`) would need them
    on the host, i.e. the sync this round exists to avoid. `async_budget`'s K assumes that per-request
    top-K selection; spreading K evenly would verify the weak tails of some requests it meant to skip
    and stop short on strong ones. Maximising Θ over the uniform plans prices exactly the plan the
    round runs.

    Shapes: stale_confidence R rows of [γ] (or None); returns an int in [M, N] (1 <= N <= γ,
    0 <= M <= N), or 0 when R = 0.
    """
    a = _stale_survival(stale_confidence, gamma)
    top = gamma if max_budget is None else max_budget
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= gamma:
        raise ValueError(f"max_budget must be an int in [1, γ={gamma}], got {max_budget!r}")
    if isinstance(min_budget, bool) or not isinstance(min_budget, int) or not 0 <= min_budget <= top:
        raise ValueError(f"min_budget must be an int in [0, max_budget={top}], got {min_budget!r}")
    rows = a.shape[0]
    if rows == 0:
        return 0
    # [N + 1] Σ_r Σ_{k<n} a_{r,k} for n = 0..N: column sums, prefix-summed
    drafted = np.concatenate([[0.0], a[:, :top].sum(dim=0).cumsum(dim=0).numpy()])
    n = np.arange(min_budget, top + 1)  # [N − M + 1]
    sps = capacity.many(rows * (1 + n))
    if min_budget == 0:  # a plain round: the table's plain curve where it has one (`CapacityTable.plain`)
        sps[0] = capacity.plain(rows)
    theta = (rows + drafted[n]) * sps
    return int(n[np.argmax(theta)])  # first maximum: the smallest budget among ties


def select_top_k(confidence: Confidence, budget: int, max_lens: Sequence[int] | None = None) -> VerifyPlan:
    """Admit the `budget` best candidates by *current* survival (ties: position, then request).

    Only candidates with a_{r,k} > 0 are eligible, so fewer than `budget` may be admitted. Because
    survivals are non-increasing along a block and ties go to the earlier position, each request's
    admitted drafts form a prefix, and (r, k) is admitted iff fewer than `budget` candidates rank
    strictly above it: a non-anticipating rule whenever `budget` is fixed beforehand.

    Shapes: confidence [R, γ]; returns a VerifyPlan with Σ ℓ_r <= budget.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    a = survival(confidence)
    rows, gamma = a.shape
    order, _ = _ranked_candidates(a, _max_lens(max_lens, rows, gamma))
    return _plan_from(order[:int(budget)], rows, gamma)


def plan_async(confidence: Confidence, stale_confidence: Sequence[Sequence[float] | torch.Tensor | None],
               capacity: CapacityTable, max_lens: Sequence[int] | None = None) -> VerifyPlan:
    """Production planner: budget from stale confidences, selection from current ones (paper §5.2).

    `async_budget(stale_confidence, ...)` fixes K (it can be computed a step ahead, so the next
    verify's batch size is known before the current step ends, as zero-overhead scheduling and
    CUDA-graph replay need), then `select_top_k(confidence, K)`.

    Shapes: confidence [R, γ]; stale_confidence R rows of [γ] or None.
    """
    a = _confidence(confidence)
    if len(stale_confidence) != a.shape[0]:
        raise ValueError(f"stale_confidence has {len(stale_confidence)} rows for R={a.shape[0]} requests")
    budget = async_budget(stale_confidence, a.shape[1], capacity, max_lens)
    return select_top_k(a, budget, max_lens)


def same_rows(planned: Sequence, stale: Sequence) -> bool:
    """Whether `stale` holds the very row objects (or None) a budget was planned over, in order: then the
    planners' result stands without recomputing. A plain round appends each request's last row again, so
    a batch that went plain plans over the same objects round after round; rows are never written after
    a round returns them, and a caller that holds them keeps their ids from being reused, so `is` is
    equality here."""
    return len(planned) == len(stale) and all(a is b for a, b in zip(planned, stale))


def _stale_survival(stale_confidence: Sequence[Sequence[float] | torch.Tensor | None], gamma: int) -> torch.Tensor:
    """Survival [R, γ] of stale confidence rows, a row None taken as survival 1 (a request with no
    confidences that old must not be starved). A row may be shorter than γ (its round drafted only the
    first w slots: auto's round in flight drafts its budget, one past it on a probe round): survival 0
    past its end, so a budget planned on it grows by at most one slot, and only where that slot earns it."""
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an int >= 0, got {gamma!r}")
    if not len(stale_confidence):
        return torch.zeros(0, gamma, dtype=torch.float64)
    # The engine passes host tensors (one per request, every round): one stack, not a float() per entry.
    ones = torch.ones(gamma, dtype=next((c.dtype for c in stale_confidence if isinstance(c, torch.Tensor)),
                                        torch.float64))
    rows = [ones if c is None else c if isinstance(c, torch.Tensor) else torch.tensor(c, dtype=torch.float64)
            for c in stale_confidence]
    shapes = [r.shape for r in rows]
    bad = next((sh for sh in shapes if len(sh) != 1 or not 1 <= sh[0] <= gamma), None)
    if bad is not None:
        raise ValueError(f"stale_confidence rows must have 1 .. γ={gamma} entries, got shape {tuple(bad)}")
    if len({r.dtype for r in rows}) > 1:
        rows = [r.to(torch.float64) for r in rows]
    if all(sh[0] == gamma for sh in shapes):
        return survival(torch.stack(rows))
    # Confidence 0 past a short row's end (survival 0 there). One stack per row width (a round drafts one
    # width for its whole batch): a cat per row, or pad_sequence, costs a few µs a row, which at hundreds
    # of requests is milliseconds of host time per round.
    padded = rows[0].new_zeros(len(rows), gamma)
    by_width: dict[int, list[int]] = {}
    for i, sh in enumerate(shapes):
        by_width.setdefault(sh[0], []).append(i)
    for width, index in by_width.items():
        padded[index, :width] = torch.stack([rows[i] for i in index])
    return survival(padded)


def _confidence(confidence: Confidence) -> torch.Tensor:
    """Validated float64 CPU tensor [R, γ] with values in [0, 1]."""
    c = confidence.detach().to("cpu", torch.float64) if isinstance(confidence, torch.Tensor) \
        else torch.tensor([list(map(float, row)) for row in confidence], dtype=torch.float64)
    if c.dim() != 2:
        if c.numel() == 0:  # an empty batch given as [] has no γ; treat it as [0, 0]
            return c.reshape(0, 0)
        raise ValueError(f"confidence must be [R, γ], got shape {tuple(c.shape)}")
    if not ((c >= 0) & (c <= 1)).all():  # NaN fails both comparisons: one pass, not three (runs every round)
        raise ValueError("confidence values must lie in [0, 1] (no NaN)")
    return c


def _max_lens(max_lens: Sequence[int] | None, rows: int, gamma: int) -> list[int]:
    if max_lens is None:
        return [gamma] * rows
    caps = [int(m) for m in max_lens]
    if len(caps) != rows or any(not 0 <= m <= gamma for m in caps):
        raise ValueError(f"max_lens must hold R={rows} values in [0, γ={gamma}], got {list(max_lens)}")
    return caps


def _ranked_candidates(a: torch.Tensor, caps: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Candidates (r, k) with a > 0 and k < caps[r], best first.

    Returns (order [N, 2] of (r, k) int64, values [N] float64). Ties go to the smaller position k,
    then the smaller request r: flattening position-major and sorting stably by -a does exactly that.
    """
    rows, gamma = a.shape
    if rows * gamma == 0:
        return np.zeros((0, 2), np.int64), np.zeros(0, np.float64)
    vals = a.numpy().T.reshape(-1)  # [γ·R] index = k·R + r
    k_idx, r_idx = np.divmod(np.arange(gamma * rows), rows)
    idx = np.flatnonzero((vals > 0) & (k_idx < np.asarray(caps, dtype=np.int64)[r_idx]))
    idx = idx[np.argsort(-vals[idx], kind="stable")]
    return np.stack([r_idx[idx], k_idx[idx]], axis=1), vals[idx]


def _plan_from(selected: np.ndarray, rows: int, gamma: int) -> VerifyPlan:
    """ℓ_r = number of selected candidates of request r (a prefix by construction)."""
    counts = np.bincount(selected[:, 0], minlength=rows) if len(selected) else np.zeros(rows, np.int64)
    return VerifyPlan(tuple(int(n) for n in counts))


def _check_plan(plan: VerifyPlan, shape: torch.Size) -> None:
    rows, gamma = shape
    if len(plan.draft_lens) != rows or any(n > gamma for n in plan.draft_lens):
        raise ValueError(f"plan {plan.draft_lens} does not fit confidences of shape [R={rows}, γ={gamma}]")
