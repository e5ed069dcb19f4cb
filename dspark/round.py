"""One decoding round: draft → plan → verify → commit (DSpark paper §2–3; specs/dspark.md §2.2–2.4).

    draft   the drafter proposes a γ-block per request from its anchor (the last committed token); a
            DSpark drafter under a fixed budget n < γ drafts only the n slots that can be verified
    plan    the planner chooses how many of the drafts each request sends to the target (ℓ_r); with
            "auto" and the asynchronous planner the round's total budget K is fixed before drafting,
            from confidences two rounds old, and K = 0 makes it a plain round that drafts nothing
    verify  one ragged target call over [anchor, x_0 .. x_{ℓ-1}] per request, then exact acceptance
    commit  rewind the target state to anchor + accepted drafts, feed those rows to the drafter,
            append accepted drafts + the correction/bonus token

Plain decoding is the same round with no drafter (ℓ_r = 0). `prefill_step` feeds prompt chunks.
Host bookkeeping lives in `dspark.request`; this module only sequences the device calls.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from dspark.request import Request
from dspark.sampling import greedy, probs_from_logits, sample
from dspark.verify.acceptance import accept_greedy, verify_chain_batch
from dspark.verify.capacity import CapacityTable
from dspark.verify.planner import VerifyPlan, async_budget, plan_algorithm1, plan_fixed, same_rows, select_top_k

# "auto" (asynchronous planner): after PLAIN_PROBE_FIRST plain rounds in a row a request's next round
# drafts (budget >= 1, the plain probe), so a batch that went plain sees fresh confidences and drafts again
# once the text got easier; each further probe in a row that finds plain decoding better doubles the wait,
# up to PLAIN_PROBE_MAX (a probe costs a drafting round that the stale rows said would not pay). The
# static engine's round in flight probes every `draft_lookahead.PLAIN_PROBE_EVERY` rounds.
PLAIN_PROBE_FIRST = 4
PLAIN_PROBE_MAX = 64
# Plain rounds defer the drafter's observe of their rows until the next drafting round, or this many rows.
DEFER_ROWS = 16


@dataclass(frozen=True)
class RoundConfig:
    """How rounds verify: `draft_tokens` 0 (plain), n (fixed budget) or "auto" (planner).

    `n_draft`: passed to the drafter's `propose` as `n_draft=` (the leading block slots it drafts, a
    `DSparkDrafter` option; the engine sets it to the fixed budget), or None: the call leaves it out
    and the drafter drafts its whole block. `capacity_sampled`: the table "auto" plans a round with a
    sampled request by (None: `capacity`; `EngineConfig.capacity_sampled` says why they differ)."""

    draft_tokens: int | str = 0
    planner: str = "sync"
    capacity: CapacityTable | None = None
    n_draft: int | None = None
    capacity_sampled: CapacityTable | None = None

    def table(self, live: list[Request]) -> CapacityTable | None:
        """The capacity table of a round over `live`: `capacity_sampled` when one is set and a request
        samples (the round then runs as a sampled one), else `capacity`."""
        if self.capacity_sampled is not None and not all(r.params.greedy for r in live):
            return self.capacity_sampled
        return self.capacity


def _forward(model, requests: list[Request], chunks: list[list[int]], drafter):
    """Feed `chunks[b]` to request b in one ragged target call; returns (output, row offsets)."""
    ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=model.device)
    lens = [len(c) for c in chunks]
    capture = drafter.capture_layers if drafter is not None else ()
    out = model(ids, [r.state for r in requests], lens, capture_layers=capture)
    return out, [sum(lens[:b]) for b in range(len(lens))]


def _observe(drafter, req: Request, out, rows: slice, tokens: list[int], defer: bool = False) -> None:
    """Feed request `req`'s committed `rows` of `out` to the drafter; with `defer`, keep them until the
    request next drafts, or until DEFER_ROWS rows wait (`_catch_up`)."""
    if drafter is None:
        return
    piece = (torch.tensor(tokens, device=out.hidden.device), out.hidden[rows],
             {i: f[rows] for i, f in out.features.items()})
    req.unobserved.append(piece)
    if not defer or sum(len(p[0]) for p in req.unobserved) >= DEFER_ROWS:
        _catch_up(drafter, req)


def _catch_up(drafter, req: Request) -> None:
    """One `observe` of every row `req` committed since the drafter last saw it, in order.

    Auto's plain rounds commit one row per request and draft nothing, so nothing needs the drafter's
    context until the next drafting round, and one observe of n rows costs little more than one of a
    single row (its fixed per-call work dominates at these sizes), so deferring them saves most of a
    plain round's observe. The drafter sees the same rows and positions either way; its context rows
    may differ in the last bits (a matmul over more rows)."""
    pieces, req.unobserved = req.unobserved, []
    if len(pieces) == 1:
        drafter.observe(req.dstate, *pieces[0])
    elif pieces:
        drafter.observe(req.dstate, torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces]),
                        {i: torch.cat([p[2][i] for p in pieces]) for i in pieces[0][2]})


def _pick(logits: torch.Tensor, req: Request) -> int:
    """Next token from one row of target logits [V] under the request's sampling parameters."""
    if req.params.greedy:
        return int(logits.argmax())
    return int(sample(probs_from_logits(logits.float(), req.params), req.generator))


def prefill_step(model, drafter, requests: list[Request], chunk: int) -> None:
    """Feed the next ≤ `chunk` prompt tokens of every request; a request whose prompt is complete
    gets its first token from the last prompt row, unless it is resuming after a preemption (it
    already has its anchor)."""
    pieces = [r.feed[r.prefilled:r.prefilled + chunk] for r in requests]
    out, offsets = _forward(model, requests, pieces, drafter)
    for req, piece, off in zip(requests, pieces, offsets):
        _observe(drafter, req, out, slice(off, off + len(piece)), piece)
        req.prefilled += len(piece)
        if not req.in_prefill and not req.out:
            req.stats.prompt_tokens = len(req.prompt)
            req.commit([_pick(out.logits[off + len(piece) - 1], req)])


def _draft(drafter, live: list[Request], n_draft: int | None = None):
    """A block of k drafts for every request, grouped by temperature (the only parameter q depends on):
    k = γ, or `n_draft` when given (passed on to `propose`, `RoundConfig.n_draft`).

    Returns per-request token lists, draft distributions, confidences [B, k] and the raw confidence
    logits (a list of [k] tensors, None for drafters without a head; kept for the trace only)."""
    options = {} if n_draft is None else {"n_draft": n_draft}
    tokens, probs, conf, logits = [None] * len(live), [None] * len(live), [None] * len(live), [None] * len(live)
    groups: dict[float, list[int]] = {}
    for b, r in enumerate(live):
        groups.setdefault(r.params.temperature, []).append(b)
    anchors = [r.out[-1] for r in live]
    for members in groups.values():
        prop = drafter.propose([live[b].dstate for b in members], [anchors[b] for b in members],
                               live[members[0]].params, [live[b].generator for b in members], **options)
        z = getattr(prop, "confidence_logits", None)  # duck-typed proposals may predate the field
        # One host copy per group, not per request (each copy waits for the device).
        group_tokens, group_conf = prop.tokens.tolist(), prop.confidence.float().cpu()
        group_logits = z.float().cpu() if z is not None else None
        for j, b in enumerate(members):
            tokens[b] = group_tokens[j]
            probs[b] = prop.probs[j] if prop.probs is not None else None
            conf[b] = group_conf[j]
            logits[b] = group_logits[j] if group_logits is not None else None
    return tokens, probs, torch.stack(conf), logits


def _caps(live: list[Request], gamma: int) -> list[int]:
    """Never more drafts than a request can still commit (its bonus token included)."""
    return [min(gamma, r.remaining - 1) for r in live]


def acceptance_prior(drafter, greedy: bool) -> torch.Tensor | None:
    """fp32 [γ] conditional acceptance of the drafter's calibration for greedy (True) or sampled
    requests, or None: the row the asynchronous planners read for a request with no stale confidences."""
    calibration_for = getattr(drafter, "calibration_for", None)  # drafters without a confidence head lack it
    calibration = calibration_for(greedy) if calibration_for is not None else None
    if calibration is None or not calibration.acceptance:
        return None
    return torch.tensor(calibration.acceptance, dtype=torch.float32)


def _budget_before_drafting(live: list[Request], cfg: RoundConfig, drafter) -> tuple[int | None, bool]:
    """"auto" with the asynchronous planner: the round's total budget K, fixed before anything is drafted
    (`async_budget` over each request's confidences two rounds old, K = 0 pricing a plain round at
    `capacity.plain(R)`); None for the other modes, which size the round after drafting.

    A request without rows that old (its first two rounds) is planned with its calibration's prior
    (`StsCalibration.acceptance`, the calibration rounds' conditional acceptance, for its kind:
    greedy or sampled), else as survival 1; a prior is fixed before anything is drafted, so the
    round stays non-anticipating. Without it every request would start with two full-width drafting
    rounds, which at temperature 1 on dspark-tiny cost more than short generations gain.

    K = 0 means the round drafts nothing. A plain round makes no confidences, so the stale rows would
    stay those of the last drafting round and the batch would stay plain: once a request has run
    `probe_wait(r)` plain rounds in a row, the round drafts (K >= 1: the plain probe) and its
    confidences are fresh. Returns (K, whether the round is a plain probe); (None, False) when the
    mode sizes the round after drafting."""
    if drafter is None or cfg.draft_tokens != "auto" or cfg.planner != "async":
        return None, False
    stale = [r.confidences[0] if len(r.confidences) == 2 else acceptance_prior(drafter, r.params.greedy) for r in live]
    gamma = drafter.block_size
    caps = _caps(live, gamma)
    capacity = cfg.table(live)
    budget = 0 if _planned_plain(live, stale) else async_budget(stale, gamma, capacity, caps)
    plan = tuple(stale) if budget == 0 else None
    for r in live:
        r.plain_plan = plan
    if budget == 0 and any(r.plain_run >= probe_wait(r) for r in live):
        return async_budget(stale, gamma, capacity, caps, min_budget=1), True
    return budget, False


def _planned_plain(live: list[Request], stale: list) -> bool:
    """Whether the previous round planned exactly these requests plain from these very stale rows.

    Then K = 0 again without running `async_budget`: its inputs are the same objects, and the only
    one that moves, the caps (`remaining` shrinks), can only remove candidates, which lowers every
    drafting budget's Θ and leaves plain's. The saving is host time between two target calls, where
    the host's caches are cold (dspark-tiny on a CPU core at T = 1: auto / plain 0.935 before, 0.984
    after, `bench/results/cpu-auto-tiny-humaneval-plan-reuse.json`). One
    shared tuple per planning round makes "the same requests" cheap to check: every request carries
    it, and as many as it holds are live."""
    plan = live[0].plain_plan
    return plan is not None and all(r.plain_plan is plan for r in live) and same_rows(plan, stale)


def probe_wait(req: Request) -> int:
    """Plain rounds in a row before `req`'s next plain probe: PLAIN_PROBE_FIRST, doubled for each probe
    in a row since its last drafting round that was not a probe, at most PLAIN_PROBE_MAX."""
    return min(PLAIN_PROBE_FIRST << min(req.plain_probes, 16), PLAIN_PROBE_MAX)


def _plan(live: list[Request], confidence: torch.Tensor, cfg: RoundConfig, gamma: int,
          budget: int | None) -> VerifyPlan:
    """ℓ_r per request: the fixed budget, the `budget` best current candidates (asynchronous "auto",
    `budget` from `_budget_before_drafting`), or Algorithm 1 over the current confidences."""
    caps = _caps(live, gamma)
    if cfg.draft_tokens != "auto":
        return plan_fixed(cfg.draft_tokens, gamma, len(live), caps)
    if budget is not None:
        return select_top_k(confidence, budget, caps)
    return plan_algorithm1(confidence, cfg.table(live), caps)


def speculative_round(model, drafter, live: list[Request], cfg: RoundConfig, trace: list | None = None,
                      forward=None, draft=None) -> None:
    """One draft → plan → verify → commit round over every live (decoding) request.

    `forward(requests, blocks, drafter)` makes the verify call and returns what `_forward` does (the
    engine's static decode path passes `StaticRunner.forward`); default: the dynamic ragged call.
    `draft(requests)` drafts instead of `drafter.propose` and returns what `_draft` does; a caller
    that passes it also takes over observing, so the commit leaves `drafter.observe` alone (the
    engine's static drafter observes every row of the verify step inside `forward`: the next anchor
    position hides the rejected ones)."""
    anchors = [r.out[-1] for r in live]
    budget, probing = _budget_before_drafting(live, cfg, drafter)
    if drafter is None or budget == 0:
        drafts, probs, confidence, logits = [[] for _ in live], [None] * len(live), None, [None] * len(live)
        plan = VerifyPlan((0,) * len(live))
        if drafter is not None:  # auto's plain round: each request keeps its newest drafting round's row
            for r in live:
                r.keep_confidences()
                r.plain_run += 1
    else:
        for r in live:
            if r.unobserved:
                _catch_up(drafter, r)
        drafts, probs, confidence, logits = (draft or partial(_draft, drafter, n_draft=cfg.n_draft))(live)  # draft
        plan = _plan(live, confidence, cfg, drafter.block_size, budget)                  # plan
        for r, c in zip(live, confidence):
            r.confidences.append(c)
            r.plain_probes = r.plain_probes + 1 if probing and r.plain_run >= probe_wait(r) else 0
            r.plain_run = 0
    blocks = [[a] + d[:n] for a, d, n in zip(anchors, drafts, plan.draft_lens)]
    starts = [r.state.length for r in live]
    out, offsets = (forward or partial(_forward, model))(live, blocks, drafter)  # verify
    targets = _greedy_targets(out.logits, live, blocks, offsets)
    verdicts = _sampled_verdicts(out.logits, live, blocks, offsets, probs, targets)
    for b, (req, block, off) in enumerate(zip(live, blocks, offsets)):
        n = len(block) - 1
        accepted, nxt = accept_greedy(block[1:], targets[b]) if b in targets else verdicts[b]
        req.state.truncate(starts[b] + 1 + accepted)                             # commit
        if draft is None:
            _observe(drafter, req, out, slice(off, off + accepted + 1), block[:accepted + 1], defer=budget == 0)
        req.stats.record_round(n, accepted, drafter.block_size if drafter else 0)
        position = len(req.out)
        kept = req.commit(block[1:accepted + 1] + [nxt])
        if trace is not None:
            trace.append(trace_record(req, drafts[b], confidence, logits[b], b, n, accepted, kept, position,
                                      len(live)))


def _greedy_targets(logits: torch.Tensor, live: list[Request], blocks: list[list[int]],
                    offsets: list[int]) -> dict[int, list[int]]:
    """{b: target argmax ids of request b's rows} for every greedy request: one argmax over all N rows
    [N, V] and one host copy for the whole round, instead of a verify call and two host reads per
    request (what made the host side grow with the batch). The argmax is `verify_greedy`'s (ties to
    the lowest id), so acceptance is unchanged."""
    greedy_rows = [b for b, req in enumerate(live) if req.params.greedy]
    if not greedy_rows:
        return {}
    ids = greedy(logits).tolist()  # [N]
    return {b: ids[offsets[b]:offsets[b] + len(blocks[b])] for b in greedy_rows}


def _sampled_verdicts(logits: torch.Tensor, live: list[Request], blocks: list[list[int]], offsets: list[int],
                      probs: list, skip: dict) -> dict[int, tuple[int, int]]:
    """{b: (accepted, next token)} for every request not in `skip` (the greedy ones): one
    `verify_chain_batch` per group of requests with the same sampling parameters (the seed aside),
    verify length and kind of draft distribution, each row drawing from its request's own generator,
    and one host copy for the round. A verify call per request cost ~0.7 ms of host time and two host
    syncs (64 sampled requests: 45 ms a round on an H200). With equal lengths no row is padded, so each
    request reads its generator exactly as a call of its own would (`verify_sample_batch`): the same
    tokens on any device."""
    groups: dict[tuple, list[int]] = {}
    for b, req in enumerate(live):
        if b not in skip:
            key = (dataclasses.replace(req.params, seed=None), len(blocks[b]) - 1, probs[b] is None)
            groups.setdefault(key, []).append(b)
    order, accepted, nxt = [], [], []
    for (params, n, no_q), members in groups.items():
        drafts = torch.tensor([blocks[b][1:] for b in members], dtype=torch.long).reshape(len(members), n)
        q = None if no_q else torch.stack([probs[b][:n] for b in members])  # [R, n, V]
        rows = torch.stack([logits[offsets[b]:offsets[b] + n + 1] for b in members])  # [R, n + 1, V]
        a, x = verify_chain_batch(drafts.to(logits.device), q, rows, [n] * len(members), params,
                                  [live[b].generator for b in members])
        order += members
        accepted.append(a)
        nxt.append(x)
    if not order:
        return {}
    host = torch.stack([torch.cat(accepted), torch.cat(nxt)]).tolist()  # one copy for every group
    return {b: (a, x) for b, a, x in zip(order, host[0], host[1])}


def trace_record(req: Request, draft: list[int], confidence, logits, b: int, verified: int, accepted: int,
                  kept: int, position: int, load: int) -> dict:
    """One row of the round trace (schema in docs/traces.md); called after `req.commit`."""
    return {
        "request_id": req.request_id, "domain": req.domain, "round": req.stats.rounds - 1,
        "position": position, "draft": draft,
        "confidence": confidence[b].tolist() if confidence is not None else [],
        "confidence_logits": logits.tolist() if logits is not None else None,
        "verified": verified, "accepted": accepted, "committed": kept, "tokens": req.out[position:],
        "bonus": accepted == verified and kept == accepted + 1, "stop": req.finish_reason == "stop",
        "load": load, "temperature": req.params.temperature,
    }
