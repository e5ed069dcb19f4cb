"""`Engine`: every request in flight advanced together, one step at a time (continuous batching).

A step (1) lets the `Scheduler` settle, grow and admit requests within the state-memory budget
(preempting the newest ones when it runs out, see `dspark.engine.scheduler`), (2) feeds one prompt
chunk to every request still in prefill (one ragged target call), (3) runs one draft → plan →
verify → commit round over every decoding request (one more ragged target call). Requests admitted
between two steps join the next one. The engine is synchronous and single-threaded; it touches the
device only through `dspark.round` and when it creates a request's state. State and pages of a
finished, aborted or preempted request are dropped at once.

The budget governs admission and preemption; the device tensors themselves still live in
per-request growable buffers, not in a paged device pool.

With `static_decode` (DeepSeek-V4 and V4.1 targets; the default on CUDA, see
`EngineConfig.static_decode`), prefill stays on that dynamic path, but every decoding
round's target call runs on a fixed pool of `max_running` static slots (`dspark.engine.static_runner`;
CUDA-graph replays on CUDA): a request moves into the next free slot at its first round, and gives the
slot back when it finishes, is aborted or is preempted; the live slots stay 0 .. n − 1 (the last one
moves into a freed gap, `dspark.engine.slots`), so a round runs on the smallest bucket of slots that
holds them. With a DSpark or an MTP drafter the
round drafts and observes on the same slots too (`dspark.engine.static_draft`,
`dspark.engine.static_mtp_draft`: the request's draft state moves into the static drafter with its
target state); the n-gram drafter keeps its dynamic path.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import torch

from dspark.draft import DRAFTER_NAMES, DSparkDrafter, MtpDrafter, resolve_drafter
from dspark.draft.static_chain import noise_key
from dspark.engine.draft_lookahead import DraftLookahead
from dspark.engine.footprint import request_footprint
from dspark.engine.lookahead import Lookahead
from dspark.engine.pages import StateAllocator
from dspark.engine.scheduler import Scheduler
from dspark.engine.slots import SlotState, SlotTable
from dspark.engine.static_draft import StaticDraftRunner
from dspark.engine.static_mtp_draft import StaticMtpRunner
from dspark.engine.static_runner import StaticRunner
from dspark.kernels.registry import OPTIONAL_BACKENDS
from dspark.models.deepseek_v4.model import DeepseekV4ForCausalLM
from dspark.models.deepseek_v41.model import DeepseekV41ForCausalLM
from dspark.profile import device_name
from dspark.request import GenerationStats, Request
from dspark.round import RoundConfig, prefill_step, speculative_round, trace_record
from dspark.sampling import SamplingParams
from dspark.validate import PLANNERS, check_draft_tokens
from dspark.verify.capacity import CapacityTable, default_cpu_table


class EngineFull(RuntimeError):
    """The waiting queue is full; retry later (the server answers 429)."""


@dataclass(frozen=True)
class EngineConfig:
    """Limits and decoding policy of one engine, validated once.

    max_running : requests decoded together; more wait in a FIFO queue of at most `max_waiting`.
    max_prompt_tokens, max_new_tokens : per-request limits (also capped by the model's positions).
    prefill_chunk : prompt tokens per request per step.
    draft_tokens : 0 (plain), n ≤ γ (fixed verification budget) or "auto" (confidence-scheduled).
        With a DSpark drafter a fixed n also trims the drafting: past its backbone (which runs all γ
        slots) the drafter computes only the n slots a round can verify (`draft_width`), so the
        proposals, confidences and trace records of such an engine hold n drafts, not γ.
    drafter : None | "dspark" | "mtp" | "ngram" | a Drafter object; used when draft_tokens != 0.
    planner : "async" (default: the production scheme, spec §4.3: budget from confidences two rounds
        old, so a round can be launched before the previous one is read) or "sync" (Algorithm 1,
        which reads each round's own confidences on the host first).
    capacity : SPS(B) table the planner reads; default: the drafter's own table for the model's device
        where it ships one (`DSparkDrafter.capacity_tables`; dspark-tiny: one measured on a CPU core, an
        H200 and an H100; on a GPU the table measured on that card first, `default_capacity`), else the
        synthetic CPU table (`default_cpu_table`). With "auto", a default CUDA table measured on
        another GPU than this one draws a warning naming both (`foreign_table`).
    capacity_sampled : the table for rounds with a sampled request (temperature > 0); default:
        `capacity` when given, else the drafter's table of sampled rounds for the device, picked per
        card as for `capacity` (`capacity_tables["cuda-sampled"]`, "cuda-h100-sampled", ...: from
        `dspark profile --engine --temperature 1`), else the same default as `capacity`. On the static
        path a sampled round runs synchronously (no round in flight, the sampled propose and
        acceptance), so its drafting rounds cost more than greedy ones relative to a plain round, and a
        greedy table would have "auto" draft where it does not pay.
    trace : keep one record per request per round (see `take_trace`).
    state_budget_bytes : device memory for per-request decode state (target and drafter), in bytes;
        None sizes it for `max_running` requests at their longest, so nothing is ever preempted.
    page_bytes : page size of the state allocator; None picks the smallest power of two holding
        16 rows of the widest kind of state.
    static_decode : run every decoding round's target call on fixed static slots (CUDA graphs on
        CUDA) instead of the dynamic ragged path; DeepSeek-V4 / V4.1 targets only. Prefill stays
        dynamic. None (default): on exactly when it can replay graphs (`static_by_default`): a V4 /
        V4.1 target on one CUDA device with the Triton MoE (the torch reference MoE reads expert counts
        on the host) and, for V4.1, Engram tables on the device; off on the CPU, where the static step
        runs eagerly and gains nothing.
    static_context : positions one static slot holds (prompt + new tokens of any request); None:
        max_prompt_tokens + max_new_tokens. The slots' memory grows with max_running × this.
    overlap : keep one greedy decode step or round in flight while the host commits the previous one
        (needs the static path): plain rounds (`dspark.engine.lookahead`) and, with a static DSpark
        drafter and a fixed `draft_tokens` or "auto" with planner "async", drafting rounds
        (`dspark.engine.draft_lookahead`; "auto" there verifies one budget per round for the whole
        batch, `planner.uniform_budget` over confidences two rounds old, budget 0 included: a plain
        step that drafts nothing but still feeds the drafter's context, where `capacity` says plain
        decoding pays more), when every request is greedy; other rounds run as usual; on the CPU the
        same tokens, no overlap.
        None (default): on exactly when the engine runs the static path; True requires that path,
        and with draft_tokens="auto" planner "async" (Algorithm 1 cannot plan a round ahead).
        One H200, v4-mini, 4K context, plain rounds: 1.07-1.09x the synchronous step (bench/README.md).
    """

    max_running: int = 64
    max_waiting: int = 1024
    max_prompt_tokens: int = 32768
    max_new_tokens: int = 4096
    prefill_chunk: int = 512
    draft_tokens: int | str = 0
    drafter: object = None
    planner: str = "async"
    capacity: CapacityTable | None = None
    capacity_sampled: CapacityTable | None = None
    trace: bool = False
    state_budget_bytes: int | None = None
    page_bytes: int | None = None
    static_decode: bool | None = None
    static_context: int | None = None
    overlap: bool | None = None

    def __post_init__(self):
        for name in ("max_running", "max_waiting", "max_prompt_tokens", "max_new_tokens", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.planner not in PLANNERS:
            raise ValueError(f"planner must be one of {PLANNERS}, got {self.planner!r}")
        check_draft_tokens(self.draft_tokens)
        if isinstance(self.drafter, str) and self.drafter not in DRAFTER_NAMES:  # even where no round drafts
            raise ValueError(f"drafter must be None, one of {DRAFTER_NAMES} or a Drafter, got {self.drafter!r}")
        for name in ("capacity", "capacity_sampled"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, CapacityTable):
                raise ValueError(f"{name} must be None or a CapacityTable, got {type(value).__name__}")
        for name in ("state_budget_bytes", "page_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")
        if self.static_decode is not None and not isinstance(self.static_decode, bool):
            raise ValueError(f"static_decode must be None (auto) or a bool, got {self.static_decode!r}")
        if self.static_context is not None:
            context = self.static_context
            if isinstance(context, bool) or not isinstance(context, int) or context < 2:
                raise ValueError(f"static_context must be None or an int >= 2, got {self.static_context!r}")
            if self.static_decode is False:
                raise ValueError(f"static_context={self.static_context} needs static_decode=True or None (auto)")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be None (auto) or a bool, got {self.overlap!r}")
        if self.overlap and self.static_decode is False:
            raise ValueError("overlap=True needs the static path (static_decode=True or None)")
        if self.overlap and self.draft_tokens == "auto" and self.planner != "async":
            raise ValueError(f"overlap=True with draft_tokens='auto' needs planner='async', got planner="
                             f"{self.planner!r}: Algorithm 1 sizes each verify from that round's confidences, "
                             f"so no round can be in flight (overlap=None runs such rounds synchronously)")

    @property
    def slot_context(self) -> int:
        """Positions (prompt + new tokens) a request may span under `static_decode`."""
        return self.static_context or self.max_prompt_tokens + self.max_new_tokens


@dataclass(frozen=True)
class StepEvent:
    """What one step did for one request: tokens committed, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stats: GenerationStats = field(repr=False)


class Engine:
    def __init__(self, model, config: EngineConfig = EngineConfig()):
        self.model = model
        self.config = config
        self.drafter = resolve_drafter(model, config.drafter) if config.draft_tokens != 0 else None
        if self.drafter is not None and config.draft_tokens != "auto" and config.draft_tokens > self.drafter.block_size:
            raise ValueError(f"draft_tokens={config.draft_tokens} exceeds the drafter's block size "
                             f"γ={self.drafter.block_size}")
        self.n_draft = draft_width(self.drafter, config.draft_tokens)
        capacity, sampled = _planner_tables(self.drafter, model, config)
        self.round_config = RoundConfig(config.draft_tokens, config.planner, capacity, self.n_draft, sampled)
        self.eos = frozenset(_eos_ids(model.config))
        self.scheduler = _scheduler(model, self.drafter, config)
        self.static = static_by_default(model) if config.static_decode is None else config.static_decode
        self.slots, self.runner, self.static_draft = (_static_path(model, self.drafter, config, self.n_draft)
                                                      if self.static else (None, None, None))
        if config.overlap and self.runner is None:
            raise ValueError(f"overlap=True needs the static path, which this engine does not run "
                             f"(static_decode={config.static_decode!r} on {type(model).__name__}, {model.device})")
        overlap = self.runner is not None if config.overlap is None else config.overlap
        self.lookahead = Lookahead(self.runner) if overlap and self.drafter is None else None
        # Algorithm 1 ("sync") sizes a verify from that round's own confidences: no round can be in flight.
        in_flight = config.draft_tokens != "auto" or config.planner == "async"
        # MTP rounds go in flight at a fixed budget only ("auto" would need plain rounds, whose deferred
        # observe only the DSpark runner has).
        ahead_drafter = isinstance(self.static_draft, StaticDraftRunner) or (
            isinstance(self.static_draft, StaticMtpRunner) and config.draft_tokens != "auto")
        self.draft_ahead = (DraftLookahead(self.runner, self.static_draft, config.draft_tokens,
                                           self.round_config.capacity)
                            if overlap and ahead_drafter and in_flight else None)
        self._ids = itertools.count()
        self._trace: list[dict] = []

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                    max_new_tokens: int = 64, stop_token_ids=(), request_id: str | None = None,
                    domain: str = "") -> str:
        """Queue one request; returns its id. ValueError names a bad argument; EngineFull when full.

        `domain` tags the request's trace records (docs/traces.md), e.g. with its evaluation set."""
        self._check_request(prompt_ids, max_new_tokens, request_id)
        if not isinstance(domain, str):
            raise ValueError(f"domain must be a str, got {domain!r}")
        if len(self.waiting) >= self.config.max_waiting:
            raise EngineFull(f"{len(self.waiting)} requests already waiting (max_waiting={self.config.max_waiting})")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        # The request's random stream lives where its sampling noise is drawn: on the model's device.
        generator = torch.Generator(device=self.model.device).manual_seed(seed)
        req = Request(list(prompt_ids), None, generator, max_new_tokens,
                      self.eos | frozenset(stop_token_ids), params, request_id=rid, domain=domain)
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> bool:
        """Drop a request, its state, its pages and its static slot; returns whether it was known."""
        self._free_slots([request_id])
        return self.scheduler.remove(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_trace(self) -> list[dict]:
        trace, self._trace = self._trace, []
        return trace

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        self._schedule()
        before = {id(r): len(r.out) for r in self.running}
        self._run_phases([r for r in self.running if r.in_prefill], [r for r in self.running if not r.in_prefill])
        return self._events(before)

    def _run_phases(self, prefilling: list[Request], decoding: list[Request]) -> None:
        """The step's target calls: one prompt chunk per prefilling request, one round over the rest."""
        if prefilling:
            self._prefill(prefilling)
        if decoding:
            self._decode(decoding)

    def _prefill(self, requests: list[Request]) -> None:
        t = time.perf_counter()
        prefill_step(self.model, self.drafter, requests, self.config.prefill_chunk)
        _charge(requests, "prefill_s", time.perf_counter() - t)

    def _decode(self, requests: list[Request]) -> None:
        t = time.perf_counter()
        if self.runner is not None:
            self._bind_slots(requests)
        if self.lookahead is not None and all(req.params.greedy for req in requests):
            self._decode_ahead(requests)
        elif self.draft_ahead is not None and self.draft_ahead.fits(requests):
            self._draft_ahead(requests)
        else:
            self._discard_ahead()  # a sampled request, or a cap in reach: this round runs the usual way
            forward = draft = None
            if self.runner is not None:
                forward = self.runner.forward
                if self.static_draft is not None:
                    forward = partial(self.runner.forward, observe=self.static_draft.observe)
                    draft = self.static_draft.draft
            speculative_round(self.model, self.drafter, requests, self.round_config,
                              self._trace if self.config.trace else None, forward, draft)
        _charge(requests, "decode_s", time.perf_counter() - t)

    def _decode_ahead(self, requests: list[Request]) -> None:
        """A plain greedy round from the step in flight (`Lookahead`): the same commit, statistics and
        trace as `speculative_round` with no drafter."""
        tokens = self.lookahead.step(requests)
        for b, (req, token) in enumerate(zip(requests, tokens)):
            req.state.advance(1)  # the anchor fed at the request's length
            req.stats.record_round(0, 0, 0)
            position = len(req.out)
            kept = req.commit([token])
            if self.config.trace:
                self._trace.append(trace_record(req, [], None, None, b, 0, 0, kept, position, len(requests)))

    def _draft_ahead(self, requests: list[Request]) -> None:
        """A greedy DSpark round from the round in flight (`DraftLookahead`): the same commit,
        statistics and trace as `speculative_round` with the static drafter. A plain round ("auto"'s
        budget 0) commits like `speculative_round` verifying 0 drafts, but its trace has no drafts or
        confidences (none were made), and each request keeps its last confidences: appended again, so
        the rows two rounds back stay the newest drafting round's (`dspark.engine.draft_lookahead`)."""
        n, results = self.draft_ahead.step(requests)
        if not n:
            self._commit_plain(requests, results.bonus)
        else:
            self._commit_drafted(requests, n, results)
        self.draft_ahead.prepare(requests)

    def _commit_drafted(self, requests: list[Request], n: int, results) -> None:
        """Commit a drafting round of `DraftLookahead` (budget n) as `speculative_round` would."""
        gamma = self.draft_ahead.gamma
        # [B, γ] as `_draft` returns it: only the trace reads it
        confidence = torch.stack(results.confidence) if self.config.trace else None
        for b, (req, drafts, accepted, bonus) in enumerate(zip(requests, results.drafts, results.accepted,
                                                               results.bonus)):
            req.confidences.append(results.confidence[b])
            start = req.state.advance(n + 1)  # the anchor and n drafts fed at the request's length
            req.state.truncate(start + 1 + accepted)
            req.stats.record_round(n, accepted, gamma)
            position = len(req.out)
            kept = req.commit(drafts[:accepted] + [bonus])
            if self.config.trace:
                self._trace.append(trace_record(req, drafts, confidence, results.confidence_logits[b], b, n,
                                                accepted, kept, position, len(requests)))

    def _commit_plain(self, requests: list[Request], tokens: list[int]) -> None:
        """Commit a plain round of `DraftLookahead` (budget 0): each request's greedy token, as
        `speculative_round` verifying 0 drafts; the trace has no drafts or confidences (none were made),
        and each request keeps its last confidences, appended again (none: it stays without)."""
        gamma = self.draft_ahead.gamma
        for b, (req, token) in enumerate(zip(requests, tokens)):
            req.keep_confidences()
            req.state.advance(1)  # the anchor fed at the request's length; nothing to truncate
            req.stats.record_round(0, 0, gamma)
            position = len(req.out)
            kept = req.commit([token])
            if self.config.trace:
                self._trace.append(trace_record(req, [], None, None, b, 0, 0, kept, position, len(requests)))

    def _discard_ahead(self) -> None:
        """Forget any step or round in flight (the batch changes, or this round runs synchronously)."""
        for ahead in (self.lookahead, self.draft_ahead):
            if ahead is not None:
                ahead.discard()

    def _bind_slots(self, requests: list[Request]) -> None:
        """Move every request new to decoding into a free static slot (its dynamic state, and its
        DSpark draft state with a static drafter, are copied there and dropped); every slot held must
        belong to one of `requests` (the static step runs all slots: a held slot left out would be
        overwritten at position 0)."""
        for req in requests:
            if not isinstance(req.state, SlotState):
                slot = self.slots.assign(req.request_id)
                req.state = SlotState(slot, self.runner.load(slot, req.state))
                if self.static_draft is not None:
                    self.static_draft.load(slot, req.dstate, req.state.length, _noise_key(req))
                    req.dstate = None
        held = self.slots.holder_slots()
        if set(held) != {r.request_id for r in requests}:
            decoding = sorted(r.request_id for r in requests)
            raise RuntimeError(f"static slots held by {sorted(held)} but decoding {decoding}")

    def _free_slots(self, request_ids: list[str]) -> None:
        """Give back the static slots of `request_ids` (all leaving the engine now) and keep the held
        slots compact: a request moved from the last held slot to a freed one takes its device rows
        (target and draft state) along. A mover that is itself leaving needs no copy."""
        if self.slots is None:
            return
        if request_ids:
            self._discard_ahead()  # the batch changes (its key would not match anyway)
        leaving = set(request_ids)
        for rid in request_ids:
            move = self.slots.release(rid)
            if move is None or move.request_id in leaving:
                continue
            req = next((r for r in self.running if r.request_id == move.request_id), None)
            if req is None or not isinstance(req.state, SlotState):
                raise RuntimeError(f"slot {move.src} is held by {move.request_id!r}, which is not decoding")
            self.runner.move(move.src, move.dst)
            if self.static_draft is not None:
                self.static_draft.move(move.src, move.dst)
            req.state.slot = move.dst

    def _schedule(self) -> None:
        admitted, preempted = self.scheduler.schedule()  # preempted requests had their state dropped there
        self._free_slots([req.request_id for req in preempted])
        for req in admitted:
            req.state = self.model.new_state()
            req.dstate = self.drafter.new_state() if self.drafter is not None else None

    def _events(self, before: dict[int, int]) -> list[StepEvent]:
        events = []
        for req in list(self.running):
            new = req.out[before[id(req)]:]
            if new or req.finish_reason:
                events.append(StepEvent(req.request_id, new, req.finish_reason is not None,
                                        req.finish_reason, req.stats))
            if req.finish_reason:
                self._free_slots([req.request_id])
                self.scheduler.finish(req)
        return events

    def _check_request(self, prompt_ids, max_new_tokens, request_id) -> None:
        vocab, limit = self.model.config.vocab_size, self.model.config.max_position_embeddings
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("prompt: expected a non-empty list of token ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            bad = next(t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab)
            raise ValueError(f"prompt: token id {bad!r} outside the vocabulary [0, {vocab})")
        if len(prompt_ids) > self.config.max_prompt_tokens:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens exceed max_prompt_tokens={self.config.max_prompt_tokens}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= self.config.max_new_tokens:
            raise ValueError(f"max_new_tokens must be an int in [1, {self.config.max_new_tokens}], got {max_new_tokens!r}")
        if len(prompt_ids) + max_new_tokens > limit:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens + max_new_tokens={max_new_tokens} exceed "
                             f"max_position_embeddings={limit}")
        if not self.scheduler.fits(len(prompt_ids), max_new_tokens):
            raise ValueError(f"prompt: {len(prompt_ids)} tokens + max_new_tokens={max_new_tokens} need more decode "
                             f"state than state_budget_bytes={self.config.state_budget_bytes} holds")
        if self.static and len(prompt_ids) + max_new_tokens > self.config.slot_context:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens + max_new_tokens={max_new_tokens} exceed "
                             f"static_context={self.config.slot_context}")
        if request_id is not None and any(r.request_id == request_id for r in itertools.chain(self.waiting, self.running)):
            raise ValueError(f"request_id {request_id!r} is already in flight")


def default_capacity(drafter, device, sampled: bool = False) -> CapacityTable:
    """The planner's table when none is given: the drafter's own for this device (for `sampled` rounds
    its table of sampled rounds where it ships one), else the synthetic CPU table. A drafter may ship
    one table per GPU ("cuda", "cuda-h100", ... and each "-sampled"): the one measured on this card
    (its conditions name it) before the device type's plain "<type>" / "<type>-sampled" one."""
    tables = getattr(drafter, "capacity_tables", None) or {}
    device = torch.device(device)
    return (sampled and _device_table(tables, device, "-sampled")) or _device_table(tables, device, "") \
        or default_cpu_table()


def _device_table(tables: dict[str, CapacityTable], device: torch.device, suffix: str) -> CapacityTable | None:
    """Of the tables keyed "<type>[-<card>]<suffix>", the one measured on this card, else "<type><suffix>"."""
    kind, sampled = device.type, suffix == "-sampled"
    mine = [t for key, t in sorted(tables.items())
            if (key == kind or key.startswith(kind + "-")) and key.endswith("-sampled") == sampled]
    if mine and kind == "cuda" and torch.cuda.is_available():  # else there is no card to match them by
        here = device_name(device)
        match = next((t for t in mine if t.conditions.get("device") == here), None)
        if match is not None:
            return match
    return tables.get(kind + suffix)


def _planner_tables(drafter, model, config: EngineConfig) -> tuple[CapacityTable, CapacityTable]:
    """(capacity, capacity_sampled) of an engine: the tables given, else the defaults, each default
    "auto" will plan by checked against this GPU (`foreign_table`: a warning naming both cards)."""
    given_sampled = config.capacity_sampled or config.capacity
    capacity = config.capacity or default_capacity(drafter, model.device)
    sampled = given_sampled or default_capacity(drafter, model.device, sampled=True)
    if config.draft_tokens == "auto":
        defaults = ([] if config.capacity else [capacity]) + ([] if given_sampled else [sampled])
        for message in dict.fromkeys(filter(None, (foreign_table(t, model.device) for t in defaults))):
            warnings.warn(message, stacklevel=3)
    return capacity, sampled


def foreign_table(table: CapacityTable, device: torch.device) -> str | None:
    """Why `table` misprices `device`, or None: a table measured on another GPU (its conditions name
    the card). Step times differ enough between cards for "auto" to draft where it does not pay
    (dspark-tiny sampled on an H100 with the H200 tables: 0.67–0.89 of plain decoding, 0.90–0.99 on
    the H200; `bench/README.md`, twenty-first session)."""
    measured = table.conditions.get("device")
    if device.type != "cuda" or not measured or measured == device_name(device):
        return None
    return (f"capacity table {table.label!r} was measured on {measured}, not this {device_name(device)}: "
            f"'auto' may draft where it does not pay; run `dspark profile --engine` here and pass "
            f"capacity= (and capacity_sampled= from `--temperature 1`)")


def draft_width(drafter, draft_tokens: int | str) -> int | None:
    """The leading block slots a DSpark drafter drafts per round in an engine of `draft_tokens`:
    min(n, γ) for a fixed budget n (the later slots are never verified, so their LM head, Markov step
    and confidence are not computed), γ for "auto" (the planner reads every slot's confidence).
    None for any other drafter (an MTP or n-gram drafter, a wrapper), which drafts its whole block."""
    if not isinstance(drafter, DSparkDrafter):
        return None
    return drafter.block_size if draft_tokens == "auto" else min(draft_tokens, drafter.block_size)


def _verify_width(drafter, config: EngineConfig) -> int:
    """Target rows of one verify call at most: the anchor + the largest verification budget."""
    gamma = 0 if drafter is None else drafter.block_size
    return 1 + (gamma if config.draft_tokens == "auto" else min(config.draft_tokens, gamma))


def static_by_default(model) -> bool:
    """`EngineConfig.static_decode=None`: static slots and CUDA graphs exactly where they replay —
    a whole (not parallelised) DeepSeek-V4 / V4.1 target on CUDA with the Triton MoE and, for V4.1,
    every Engram table on the device."""
    if not isinstance(model, (DeepseekV4ForCausalLM, DeepseekV41ForCausalLM)) or model.device.type != "cuda":
        return False
    if getattr(model, "kernels", None) is None or model.kernels.fused_moe != "triton":
        return False
    if not graph_capturable(model.kernels):
        return False
    if any(type(m).__module__.startswith("dspark.distributed") for m in model.modules()):
        return False  # sharded layers run collectives: the static step is for one device
    return not any(layer.engram is not None and layer.engram.embed.host
                   for layer in model.layers if hasattr(layer, "engram"))


def host_bound_ops(kernels) -> list[str]:
    """The ops `kernels` runs on an optional backend (`registry.OPTIONAL_BACKENDS`), as "op='impl'":
    flashinfer's attention plans on the host at each call (a device-to-host copy), deep_gemm and
    w8a8 convert each weight on its first call (a host sync; deep_gemm also JIT-compiles); a CUDA
    graph holds none of them."""
    return [f"{f.name}={getattr(kernels, f.name)!r}" for f in dataclasses.fields(kernels)
            if getattr(kernels, f.name) in OPTIONAL_BACKENDS]


def graph_capturable(kernels) -> bool:
    """Whether every op `kernels` picks can run inside a captured step (`host_bound_ops`)."""
    return not host_bound_ops(kernels)


def _static_path(model, drafter, config: EngineConfig, n_draft: int | None) -> tuple[
        SlotTable, StaticRunner, StaticDraftRunner | StaticMtpRunner | None]:
    """The slot table, static runner and (for a DSpark or MTP drafter) static drafting of
    `static_decode`: `max_running` slots, T = the verify width; a DSpark drafter drafts `n_draft`
    slots per block (`draft_width`)."""
    if not isinstance(model, (DeepseekV4ForCausalLM, DeepseekV41ForCausalLM)):
        raise ValueError(f"static_decode supports DeepSeek-V4 and V4.1 targets only, got {type(model).__name__}")
    if not graph_capturable(model.kernels):
        raise ValueError(f"static_decode needs graph-capturable kernels, but the model runs "
                         f"{', '.join(host_bound_ops(model.kernels))} (host work at each or the first call); "
                         f"use static_decode=False, or 'triton' for those ops")
    tokens = _verify_width(drafter, config)
    # A request of `slot_context` positions verifies at most T tokens from its last anchor.
    context = config.slot_context + tokens
    drafting = None
    if isinstance(drafter, DSparkDrafter):
        drafting = StaticDraftRunner(drafter, config.max_running, tokens, n_draft,
                                     narrower=config.draft_tokens == "auto")  # auto's round in flight
    elif isinstance(drafter, MtpDrafter):
        drafting = StaticMtpRunner(drafter, config.max_running, context, tokens)
    capture = drafting.capture_layers if isinstance(drafting, StaticMtpRunner) else \
        drafter.capture_layers if drafter is not None else ()
    runner = StaticRunner(model, config.max_running, context, tokens, capture)
    return SlotTable(config.max_running), runner, drafting


def _scheduler(model, drafter, config: EngineConfig) -> Scheduler:
    """The scheduler over a page allocator sized from `config` for this (target, drafter) pair."""
    footprint = request_footprint(model, drafter)
    width = _verify_width(drafter, config)
    page_bytes = config.page_bytes or 1 << (16 * footprint.max_row_bytes - 1).bit_length()
    allocator = StateAllocator(footprint, 1, page_bytes)  # sized below, once pages_needed is known
    widest = max(config.prefill_chunk, width)
    if config.state_budget_bytes is None:
        longest = config.max_prompt_tokens + config.max_new_tokens
        num_pages = config.max_running * sum(allocator.pages_needed(longest, widest))
    else:
        num_pages = config.state_budget_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(f"state_budget_bytes={config.state_budget_bytes} is less than one page "
                             f"({page_bytes} bytes)")
    return Scheduler(StateAllocator(footprint, num_pages, page_bytes), config.max_running,
                     config.prefill_chunk, width)


def _charge(requests: list[Request], what: str, seconds: float) -> None:
    """Add a step's wall time to every request that took part in it."""
    for r in requests:
        setattr(r.stats, what, getattr(r.stats, what) + seconds)


def _noise_key(req: Request) -> int:
    """The key a request's sampled static drafts hash (`dspark.kernels.slot_noise`): from its seed, or,
    unseeded, from the seed its generator was given, so that its drafts depend on the request alone."""
    seed = req.params.seed if req.params.seed is not None else req.generator.initial_seed()
    return noise_key(seed)


def _eos_ids(config) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
