"""One DSpark round in flight while the host commits the previous one (greedy, static slots); with
"auto", plain rounds where plain decoding pays more.

    ahead = DraftLookahead(runner, drafting, budget=3)   # the engine's `StaticRunner` and `StaticDraftRunner`
    ahead = DraftLookahead(runner, drafting, "auto", capacity)   # a budget per round, from stale confidences
    if ahead.fits(requests):
        n, results = ahead.step(requests)                # the round's budget (0: a plain round) and its
                                                         # `RoundResults`: drafts, accepted, bonus, confidences
    ahead.prepare(requests)                              # after the commit: plan the next round while
                                                         # the device runs the one in flight ("auto")
    ahead.discard()                                      # when the batch changes outside a round

A greedy round with a fixed budget n needs the host for nothing but bookkeeping: the drafts, the
verification's argmax, the accepted length a = the longest prefix of the n drafts that the argmax
repeats, and the bonus token argmax[a] are all device values, and so are the next round's inputs
(anchor = bonus at position start + a + 1). So after launching round k (propose, verify, observe,
accept), `step` launches round k + 1 from round k's device results *before* it reads round k: the host
then waits for round k only (an event after its results were copied to pinned host memory) and commits
it while the GPU drafts and verifies round k + 1, the way `lookahead.py` runs plain greedy steps.

Round k + 1 is a guess that the batch stays the same and is only launched when no request could meet
its budget cap or its static capacity in it, whatever round k accepts (`remaining >= n + n' + 2`,
`length + n + n' + 2 <= max_context` for budgets n of round k and n' of round k + 1): then it verifies
exactly the n' drafts the synchronous round with that budget would.

The budget. A fixed budget n serves every round. With "auto" each round j gets one budget for the whole
bucket, `planner.uniform_budget` over the confidences of each request's round j − 2 (None when it has
none: a new, rebuilt or young request) and the capacity table: when round k + 1 is launched, round k
has not been read, so round k − 1 is the newest the host has, "two steps back" as in the asynchronous
planner (spec §4.3; `round._plan` uses the same rows for `plan_async`). A round launched from the host
(nothing usable in flight) uses the same rule, so a round's budget never depends on how it was
launched. One n for all requests because the step verifies [b, 1 + n] (a graph per width, all captured
with the runner for widths up to γ + 1) and choosing per request would need the current confidences
on the host (`uniform_budget` says more).

Plain rounds (budget 0, "auto" only). `uniform_budget(..., min_budget=0)` also prices n = 0: τ = R
tokens at SPS(R), the capacity table's entry at B = R, which is what a plain step of R requests costs
when the table is profiled that way (`bench/engine_h200.py --table-from-cells` takes it from the
'none' cell; `dspark profile` tables price B target tokens of width-4 blocks, see
`dspark.verify.capacity`). When it wins, e.g. a large batch whose step is compute-bound, the round
is a plain greedy step: no propose, the target verifies [b, 1] rows (the anchors; the width-1 graph),
the drafter observes the step's features at the anchors' positions exactly as a drafting round
observes its rows (so its context holds every committed token and a later drafting round drafts from
the same context as an engine that never stopped drafting), accepted = 0 and the bonus is the argmax.
Such a round chains like any other (next anchor = its bonus at start + 1), so switching between plain
and drafting rounds needs no drop: each launched round carries its own budget, and one launched from
the host gets the budget of the same rule. No confidences are made while plain: a request keeps its
last known row, which the engine appends again after each plain round (`Engine._commit_plain`), so
"the newest drafting round at or before j − 2" is what both a chained and a host-launched round j read;
a request with none reads its drafter's calibration prior (`round.acceptance_prior`: the calibration
rounds' greedy conditional acceptance, one row object for the engine's life, so the plan cache below
holds), as the dynamic path plans a request's first rounds; a drafter without one reads None
(survival 1). A batch that went plain would therefore stay plain until its
membership changes, so after `plain_probe_every` (16) plain rounds in a row the next round drafts at
budget 1, one slot past it (the plain probe): its confidences are the fresh rows the rounds two on plan
over, and the batch drafts again where the text got easier, or returns to plain rounds, for twice as
many before the next probe (`plain_probe_wait`: each probe in a row doubles the wait, up to
PLAIN_PROBE_BACKOFF times, as the dynamic path's `round.probe_wait`; a drafting round that is not a
probe resets it). The counts are of rounds run (`step`, `count`; each round carries whether it is the
probe), so a chained and a host-launched round get the same budget. Fixed
budgets never run plain rounds.

A plain round costs what a `Lookahead` step costs plus the deferred observe (`StaticDraftRunner`
copies its rows into the inputs of one observe per T plain rounds): besides the target graph it runs
the row copies, the argmax, the next inputs and the bonus's copy to pinned memory (no draft,
acceptance, mask or confidence op), its results are the bonus column, and
`plan` reuses its budget while the stale rows are the very objects it planned last (a plain batch's
rows do not change), so no planning runs per plain round.

When the batch changes (a request finished, was aborted or preempted, one joined, a slot moved), the
round in flight no longer matches the requests' committed lengths and is dropped: every row it wrote
(target and drafter) lies past a request's committed length, which the static states' position rule
hides and the next round overwrites, as it does a rejected draft. Output, statistics and traces equal
the synchronous engine's (tests/engine/test_engine_draft_lookahead.py).

Host syncs: one per round (the event of the round whose results are read). On the CPU everything runs
eagerly and in order (the logic is the same, the overlap is not).

Shape symbols: b the round's bucket of slots, n the round's budget (drafts verified), γ the block size,
k the slots the static drafter drafts (its `n_draft`: the fixed budget, or γ for "auto").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.slots import bucket
from dspark.round import acceptance_prior
from dspark.sampling import greedy
from dspark.verify.capacity import CapacityTable
from dspark.verify.planner import same_rows, uniform_budget

Key = tuple[tuple[str, int, int], ...]  # (request id, slot, anchor position) of each request, in order
# "auto": one drafting round in this many drafts a slot past its budget (the probe that lets it grow).
PROBE_EVERY = 4
# "auto": after this many plain rounds in a row, one round drafts at budget 1 (a slot past it as well), so
# that a batch that went plain sees fresh confidences and drafts again once the text got easier; each
# probe in a row (no other drafting round between them) doubles the wait, up to PLAIN_PROBE_BACKOFF times.
PLAIN_PROBE_EVERY = 16
PLAIN_PROBE_BACKOFF = 16


@dataclass
class RoundResults:
    """A round's results, one column per field, in request order: the k drafts of each request, how many
    of the n verified it accepted, its bonus token, and its confidences [k] and their raw logits [k]
    (host tensors). A plain round (n = 0): no drafts or confidences (None), accepted all 0."""

    drafts: list[list[int]] | None  # R lists of k ids
    accepted: list[int]  # [R]
    bonus: list[int]  # [R]
    confidence: list[torch.Tensor] | None  # R rows [k]
    confidence_logits: list[torch.Tensor] | None  # R rows [k]


@dataclass
class InFlightRound:
    """A launched round: its inputs and device results, and their host copies behind `event`."""

    key: Key | None  # None until the round it was chained from has been read
    budget: int  # n: drafts each request verifies
    live: torch.Tensor  # [b] bool: slots that hold one of the requests
    next_anchors: torch.Tensor  # [b] long: the bonus token (free slots: 0)
    next_positions: torch.Tensor  # [b] long: positions + accepted + 1 (free slots: 0)
    host_ids: torch.Tensor  # [b, k + 2] long: drafts, accepted, bonus (a plain round: [b], the bonus)
    host_conf: torch.Tensor | None  # [b, 2, k] fp32: confidences, their logits (None: a plain round)
    event: torch.cuda.Event | None
    has_logits: bool = True  # the drafter has a confidence head (MTP has none: its rows read None)
    probe: bool = False  # a plain probe: budget 1 where the rule said plain (`DraftLookahead.plan`)

    def read(self, slots: list[int]) -> RoundResults:
        """The results of the requests at `slots` [R], in that order; waits for this round only."""
        if self.event is not None:
            self.event.synchronize()
        ids = self.host_ids.tolist()
        if not self.budget:  # a plain round: only the bonus column exists
            return RoundResults(None, [0] * len(slots), [ids[s] for s in slots], None, None)
        rows = [ids[s] for s in slots]
        k = len(rows[0]) - 2 if rows else 0
        conf = self.host_conf
        return RoundResults([r[:k] for r in rows], [r[k] for r in rows], [r[k + 1] for r in rows],
                            [conf[s, 0] for s in slots],
                            [conf[s, 1] for s in slots] if self.has_logits else [None] * len(slots))


class DraftLookahead:
    """Greedy DSpark rounds over the static path, one round ahead, at a fixed budget or "auto" (plain
    rounds included; module docstring). `drafting` is the engine's `StaticDraftRunner`, or, at a fixed
    budget, its `StaticMtpRunner` (MTP: no confidence head, its observe pairs rows with the step's ids)."""

    def __init__(self, runner, drafting, budget: int | str, capacity: CapacityTable | None = None,
                 probe_every: int = PROBE_EVERY, plain_probe_every: int | None = PLAIN_PROBE_EVERY):
        gamma = drafting.static.drafter.block_size
        # A DSpark runner drafts its first n_draft slots; an MTP runner (`StaticMtpRunner`) its whole block.
        self.n_draft = getattr(drafting.static, "n_draft", gamma)
        if budget == "auto":
            if not isinstance(capacity, CapacityTable):
                raise ValueError(f"budget 'auto' needs a CapacityTable to plan with, got capacity={capacity!r}")
            if not hasattr(drafting, "flush"):
                raise ValueError("budget 'auto' in flight needs the static DSpark drafter (plain rounds defer "
                                 f"their observe, budgets from its confidences); got {type(drafting).__name__}")
            widest = gamma
        elif isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= gamma:
            raise ValueError(f"budget must be an int in [1, γ={gamma}] or 'auto', got {budget!r}")
        else:
            widest = budget
        if widest + 1 > runner.shape.tokens:
            raise ValueError(f"budget {budget!r} needs {widest + 1} rows per step; the static step takes "
                             f"{runner.shape.tokens}")
        if widest > self.n_draft:
            raise ValueError(f"budget {budget!r} verifies up to {widest} drafts; the static drafter drafts "
                             f"n_draft={self.n_draft}")
        if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"probe_every must be an int >= 1, got {probe_every!r}")
        if plain_probe_every is not None and (isinstance(plain_probe_every, bool) or not isinstance(plain_probe_every, int)
                                              or plain_probe_every < 1):
            raise ValueError(f"plain_probe_every must be None or an int >= 1, got {plain_probe_every!r}")
        self.runner, self.drafting, self.budget, self.gamma = runner, drafting, budget, gamma
        self.probe_every, self._drafting_rounds = probe_every, 0  # "auto": which rounds draft past their budget
        self.plain_probe_every = plain_probe_every  # "auto": plain rounds in a row before a drafting probe
        self._plain_run = 0  # plain rounds in a row among those run (`step`), up to the newest
        self._plain_probes = 0  # plain probes run since the last drafting round that was not one
        self._probe = False  # whether the last `plan` turned a plain decision into the plain probe
        self._after_plain = False  # the last round launched was plain: the next drafting one probes a slot further
        self.capacity = capacity
        # "auto": the stale row of a request with none of its own (rounds in flight are greedy)
        self.prior = acceptance_prior(drafting.static.drafter, greedy=True) if budget == "auto" else None
        self.pending: InFlightRound | None = None
        self._planned: tuple[list, int] | None = None  # the last stale rows planned (held) and their budget

    def discard(self) -> None:
        """Forget the round in flight (its rows are invisible past every committed length) and end the
        drafter's run of deferred rows: a dropped plain round's row is in it, and the next round feeds
        that position again (`static_draft.py`)."""
        if self.pending is None:
            return
        self.pending = None
        flush = getattr(self.drafting, "flush", None)  # an MTP runner defers nothing
        if flush is not None:
            flush()

    def fits(self, requests: list) -> bool:
        """Whether every request is greedy and verifies the full budget of its next round (the
        synchronous round caps it at `remaining − 1`) within its static capacity."""
        if not all(r.params.greedy for r in requests):
            return False
        key, n = self._next(requests)
        return self._room(requests, key, n + 1)

    def _room(self, requests: list, key: Key, rows: int) -> bool:
        """Whether every request may still emit `rows` tokens and its slot hold `rows` more positions
        (the least remaining budget and the longest length, `key`'s lengths: one pass each)."""
        return min((r.remaining for r in requests), default=rows) >= rows and \
            max((start for _, _, start in key), default=0) + rows <= self.runner.shape.max_context

    def plan(self, stale: list) -> int:
        """The budget of a round whose requests' confidences two rounds back are `stale` (rows [γ] or
        None): the fixed budget, or `uniform_budget` over them with n = 0 (a plain round) allowed; 1
        instead of 0 after `plain_probe_wait()` plain rounds in a row (the plain probe: plain rounds
        refresh no confidence, so without it a batch that went plain would stay plain)."""
        if self.budget != "auto":
            return self.budget
        last = self._planned  # a batch that went plain plans over the same rows every round: reuse the budget
        if last is not None and same_rows(last[0], stale):
            n = last[1]
        else:
            n = uniform_budget(stale, self.gamma, self.capacity, min_budget=0)
            self._planned = (list(stale), n)
        self._probe = n == 0 and self.plain_probe_every is not None and self._plain_run >= self.plain_probe_wait()
        return 1 if self._probe else n

    def plain_probe_wait(self) -> int:
        """Plain rounds in a row before the next plain probe: `plain_probe_every`, doubled for each probe
        run in a row since the last drafting round that was not one (a probe that found plain decoding
        still better), at most PLAIN_PROBE_BACKOFF times (the dynamic path's `round.probe_wait` rule)."""
        return self.plain_probe_every * min(1 << self._plain_probes, PLAIN_PROBE_BACKOFF)

    def count(self, n: int, probe: bool) -> None:
        """Count a round run at budget n (`probe`: it was the plain probe) toward the next probe."""
        self._plain_run = self._plain_run + 1 if n == 0 else 0
        if n:
            self._plain_probes = self._plain_probes + 1 if probe else 0

    def prepare(self, requests: list) -> None:
        """Plan now the budget of the round after the one in flight, once the caller has committed the
        round `step` returned (its confidences are the rows that budget reads two back): the device
        is still running the round in flight, so the plan costs the host nothing on the critical path
        even when every step is waited for, and `step` finds it in `plan`'s cache (the same row
        objects). A batch that changes in between plans over its own rows in `step` (a cache miss)."""
        if self.budget == "auto" and self.pending is not None:
            self.plan([r.confidences[-1] if r.confidences else self.prior for r in requests])

    def step(self, requests: list) -> tuple[int, RoundResults]:
        """The next round of every request (each holding a static slot, `fits`): its budget n (0: a plain
        round) and each request's result; launches the round after it first when that one cannot outgrow
        a cap. Does not touch the requests: the caller commits (advance n + 1 rows, truncate to anchor +
        accepted + 1) and appends the confidences, or after a plain round the last ones again (which the
        next rounds' budgets read)."""
        key, n = self._next(requests)
        current = self.pending if self.pending is not None and self.pending.key == key else None
        if current is None:
            self.discard()
            current = self._launch_from_host(requests, key, n)
            current.probe = self._probe  # `_next` planned it
        self.count(n, current.probe)  # round k runs: the plain probe counts it
        # Round k + 1's rows two back are round k − 1's, the newest read: each request's last confidences.
        n_next = self.plan([r.confidences[-1] if r.confidences else self.prior for r in requests])
        chain = self._room(requests, key, n + n_next + 2)
        probe_next = self._probe
        self.pending = self._launch(None, n_next, current.next_anchors, current.next_positions, current.live) \
            if chain else None
        if self.pending is not None:
            self.pending.probe = probe_next
        results = current.read([slot for _, slot, _ in key])
        if self.pending is not None:  # launched at the positions this round's acceptance gives
            self.pending.key = tuple((rid, slot, start + 1 + accepted)
                                     for (rid, slot, start), accepted in zip(key, results.accepted))
        return n, results

    def _next(self, requests: list) -> tuple[Key, int]:
        """The next round's key and budget: the round in flight's when it matches the batch, else the
        budget a launch from the host gets (rows two back: the older of the last two read)."""
        key: Key = tuple((r.request_id, r.state.slot, r.state.length) for r in requests)
        if self.pending is not None and self.pending.key == key:
            return key, self.pending.budget
        return key, self.plan([r.confidences[0] if len(r.confidences) == 2 else self.prior for r in requests])

    def _launch_from_host(self, requests: list, key: Key, n: int) -> InFlightRound:
        """Round k from host values: each request's last token at its length (the planners' checks)."""
        b = bucket(max(slot for _, slot, _ in key) + 1, self.runner.shape.slots)
        anchors, positions, live = [0] * b, [0] * b, [False] * b
        for req, (_, slot, start) in zip(requests, key):
            anchors[slot], positions[slot], live[slot] = req.out[-1], start, True
        # `fits` checked every round's rows against the static capacity; the drafter's plan checks the
        # anchors (the target's vocabulary) and positions and copies them to the device.
        anchors, positions, _ = self.drafting.static.plan(anchors, positions)
        return self._launch(key, n, anchors, positions, torch.tensor(live).to(positions.device, non_blocking=True))

    def _launch(self, key: Key | None, n: int, anchors: torch.Tensor, positions: torch.Tensor,
                live: torch.Tensor) -> InFlightRound:
        """Propose, verify the first n drafts, observe, accept: device inputs [b] (free slots: anchor 0 at
        position 0), no host value read. n = 0: a plain step (`_launch_plain`)."""
        if not n:
            return self._launch_plain(key, anchors, positions, live)
        proposal = self.drafting.propose(anchors, positions, self._width(n))
        # Copied out at once: propose's graph shares its memory pool with observe's graphs, whose
        # replay below may reuse the blocks of propose's outputs (captured after them).
        drafts = proposal.tokens.clone()  # [b, k]
        logits = proposal.confidence_logits  # None without a confidence head (MTP): the row holds c again
        conf_dev = torch.stack([proposal.confidence.float(),
                                (proposal.confidence if logits is None else logits).float()], dim=1)
        ids = torch.where(live[:, None], torch.cat([anchors[:, None], drafts[:, :n]], dim=1), 0)  # [b, n + 1]
        out = self.runner.step(ids, positions)
        argmax = greedy(out.logits)  # [b, n + 1]; ties to the lowest id, as `verify_greedy`
        # every row (MTP pairs them with the step's ids); the next anchor position hides the rest
        self.drafting.observe(out.features, positions, ids)
        accepted = (drafts[:, :n] == argmax[:, :n]).long().cumprod(dim=1).sum(dim=1)  # [b]
        bonus = argmax.gather(1, accepted[:, None]).squeeze(1)  # [b]
        next_anchors = torch.where(live, bonus, 0)
        next_positions = torch.where(live, positions + accepted + 1, 0)
        ids_dev = torch.cat([drafts, accepted[:, None], bonus[:, None]], dim=1)  # [b, k + 2]
        host_ids, host_conf, event = _to_host(ids_dev, conf_dev)
        return InFlightRound(key, n, live, next_anchors, next_positions, host_ids, host_conf, event, logits is not None)

    def _width(self, n: int) -> int | None:
        """Slots to draft for a round verifying n: the drafter's k at a fixed budget. Under "auto" n, and
        n + 1 (at most k) on every `probe_every`-th drafting round (the first included), so that the
        round two on sees one slot past this budget (`uniform_budget` reads a shorter row as survival 0
        past its end: the budget can grow a slot per probe, and shrink at any round), and so does the first
        drafting round after a plain one (the plain probe's, or a batch change's) without paying the
        LM head, Markov step and confidence of slots no round verifies: on one H200 an extra slot every
        round cost auto 2.4-5.4 % against the fixed budget it chose (`bench/README.md`, thirteenth session)."""
        if self.budget != "auto":
            return None
        probe = self._drafting_rounds % self.probe_every == 0 or self._after_plain
        self._drafting_rounds += 1
        self._after_plain = False
        return min(self.n_draft, n + 1 if probe else n)

    def _launch_plain(self, key: Key | None, anchors: torch.Tensor, positions: torch.Tensor,
                      live: torch.Tensor) -> InFlightRound:
        """A plain step: the target's width-1 step over the anchors, the drafter's observe of its rows,
        the argmax as the bonus. Nothing drafted, so nothing to accept, mask or copy but the bonus: the
        eager ops besides the two graphs are the argmax, the next inputs and the bonus's host copy, no
        more than `Lookahead`'s step (a free slot's anchor and position are 0 already, launched from the
        host or chained, so the ids need no mask)."""
        self._after_plain = True
        out = self.runner.step(anchors[:, None], positions)  # [b, 1] ids
        bonus = greedy(out.logits[:, 0])  # [b]; ties to the lowest id, as `verify_greedy`
        self.drafting.observe(out.features, positions)  # one row per slot: deferred (`static_draft.py`)
        next_anchors = torch.where(live, bonus, 0)
        next_positions = positions + live  # free slots stay at position 0
        host_ids, _, event = _to_host(next_anchors, None)
        return InFlightRound(key, 0, live, next_anchors, next_positions, host_ids, None, event)


def _to_host(ids: torch.Tensor, conf: torch.Tensor | None):
    """(ids, conf, event): pinned host copies of the device tensors, queued on the current stream and
    valid once `event` completed; on the CPU the tensors themselves and no event."""
    if ids.device.type != "cuda":
        return ids, conf, None
    host_ids, host_conf = _pinned(ids), _pinned(conf) if conf is not None else None
    event = torch.cuda.Event()
    event.record()
    return host_ids, host_conf, event


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of device tensor `t`, queued on the current stream."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
