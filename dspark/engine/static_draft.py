"""The engine's DSpark drafting on the static slots (`static_decode` with a `DSparkDrafter`).

    drafting = StaticDraftRunner(drafter, slots=64, tokens=4, n_draft=3)  # before any request is loaded
    drafting.load(slot, req.dstate, length, key)   # at the request's first round, with its target state
    tokens, probs, conf, logits = drafting.draft(requests)   # what `dspark.round._draft` returns
    runner.forward(requests, blocks, drafter, observe=drafting.observe)   # every slot's verify rows

The slots are the target's: a request drafts from the `StaticDrafter` slot with its target slot's
number, so one `propose` over the bucket of the first b slots (the target step's bucket,
`dspark.engine.slots.bucket` of the highest live slot + 1) serves every live request (free slots of
the bucket draft from anchor 0 at position 0; their results are dropped and change no other slot). A
slot's anchor position is its target length (`SlotState.length`), which after every commit equals
the number of committed rows. Each block drafts its first `n_draft` k slots (the engine's fixed budget,
or γ for "auto"): the captured graphs compute k slots past the backbone, and every proposal is [b, k].

`observe` writes all t rows of every slot of a verify step at the step's starts: the anchor, the
accepted and the rejected drafts and the padding. The next anchor position (start + 1 + accepted)
hides the rest, and the next step's rows overwrite them (`static_context.py`'s rollback rule; t <= T
= the runner's verify width, so a step never reaches past what the rings keep).

Greedy and sampled requests. On CUDA the greedy `propose` of each bucket b and the `observe` of each
(b, t), t = 1 .. T, are CUDA graphs (`ProposeGraph`, `ObserveGraph`, captured here before any
request is loaded: their warm-up writes every slot). A round with any sampled request runs the
sampled static `propose` for the whole batch instead, with per-slot temperatures (0 on greedy rows,
whose tokens are then the same argmax chain the greedy graph gives) and counter-based noise keyed by
each slot's request (`dspark.kernels.slot_noise`; the key, from the request's seed, is loaded with its
slot and moves with it), so one call keeps a mixed batch to one backbone pass. On CUDA that call is
a graph too (`SampledGraphs`: one `SampledProposeGraph` per bucket, captured at the bucket's first
sampled round). Verification uses the q returned with each sampled block and the request's own
generator, so outputs follow the target distribution, and a seeded request's drafts and tokens
depend on its seed alone, not on its slot or batch.

A plain round of the round in flight (budget 0, `draft_lookahead.py`) observes with `observe_aside`:
the observe graph replays on a side stream behind the step that made its features, and the current
stream waits only until its inputs are copied, so the next step's target graph runs beside it (in
a run of plain rounds nothing waits for the observe). Every other call of the runner (observe,
propose, load, move) first has the current stream wait for it, so the drafter's rings are only ever
read or written in order.

This module and `static_runner.py` are the static path's device side; slot numbers and lengths are
host values kept by `dspark.engine.slots`.

Shape symbols: S slots, b a call's bucket, T rows per verify step at most, t this step's, γ block
size, k ≤ γ slots drafted, V vocabulary, n_hc streams, D hidden size, B live requests.
"""

from __future__ import annotations

import torch

from dspark.draft.context import DSparkState
from dspark.draft.drafter import DSparkDrafter
from dspark.draft.static_context import StaticDraftShape
from dspark.draft.static_drafter import StaticDrafter
from dspark.draft.static_graph import ObserveGraph, ProposeGraph, SampledProposeGraph
from dspark.engine.slots import bucket, buckets


class SampledGraphs:
    """The sampled propose of a static drafter as CUDA graphs, one per bucket, each captured at its
    first call (its buffers are the probs [b, k, V] fp32 of b slots: only the buckets a sampled round
    used hold them). The graphs share one memory pool of their own: a replay may overwrite another
    bucket's outputs, which a round has consumed by then, but never the greedy graphs' buffers (the
    observe graph replays between a sampled propose and the acceptance that reads its q)."""

    def __init__(self, propose, device: torch.device):
        self.propose, self.device = propose, device
        self.graphs: dict[int, SampledProposeGraph] = {}  # b -> graph
        self._pool = None

    def __call__(self, anchors: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor):
        """`propose(anchors, positions, temperature)` of slots 0 .. b − 1 (b = len(anchors)),
        replayed from the bucket's graph (the proposal's buffers: valid until the next sampled call)."""
        b = anchors.shape[0]
        graph = self.graphs.get(b)
        if graph is None:
            graph = self.graphs[b] = SampledProposeGraph(self.propose, b, self.device, self._pool)
            self._pool = graph.pool()
        return graph.replay(anchors, positions, temperature)


class StaticDraftRunner:
    """A `StaticDrafter` over `slots` slots taking up to `tokens` rows per observe and drafting the
    first `n_draft` k slots of each block (default γ), with its CUDA graphs. `narrower`: greedy
    proposes of every width 1 .. k − 1 get graphs too (`propose(..., width)`: auto's round in flight
    drafts its budget, or one slot past it on a probe round, `draft_lookahead.py`)."""

    def __init__(self, drafter: DSparkDrafter, slots: int, tokens: int, n_draft: int | None = None,
                 narrower: bool = False):
        self.static = StaticDrafter(drafter, StaticDraftShape(slots, tokens), n_draft)
        device = self.static.device
        self.observe_graphs: dict[tuple[int, int], ObserveGraph] = {}  # (b, t) -> graph
        self.propose_graphs: dict[tuple[int, int], ProposeGraph] = {}  # (b, width) -> graph
        self._side: torch.cuda.Stream | None = None  # `observe_aside`'s stream (created at its first call)
        self._aside: torch.cuda.Event | None = None  # the end of the last observe_aside not waited for
        self.sampled_graphs = SampledGraphs(self.static.propose, device) if device.type == "cuda" else None
        if device.type == "cuda":  # before any request is loaded: the observe warm-ups write every slot
            pool = None
            for b in buckets(slots):
                for t in range(1, tokens + 1):
                    graph = self.observe_graphs[b, t] = ObserveGraph(self.static, t, pool=pool, slots=b)
                    pool = graph.pool()
                for width in self.widths(narrower):
                    self.propose_graphs[b, width] = ProposeGraph(self.static, pool=pool, slots=b, width=width)

    @property
    def slots(self) -> int:
        return self.static.shape.slots

    def widths(self, narrower: bool) -> range:
        """The greedy propose widths with graphs: k alone, or 1 .. k (a round verifying n >= 1 drafts n,
        or n + 1 on a probe round)."""
        k = self.static.n_draft
        return range(1 if narrower else k, k + 1)

    def load(self, slot: int, dstate: DSparkState, length: int, key: int = 0) -> None:
        """Copy a request's dynamic draft state and noise key into `slot`; `length` is its target
        length (the position of its next anchor), which the draft state must have reached too."""
        self.join()
        drafted = self.static.load(slot, dstate, key)
        if drafted != length:
            raise RuntimeError(f"slot {slot}: the draft state holds {drafted} positions but the target {length}")

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s draft state (with its target slot; between rounds)."""
        self.join()
        self.static.move(src, dst)

    def observe(self, features: dict[int, torch.Tensor], starts: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        """Every bucket slot's rows of one verify step: features {layer: [b, t, n_hc, D]}, starts long
        [b] (device tensors, the target step's own); the step's ids [b, t] are not needed (DSpark's
        context keys come from the features alone)."""
        self.join()
        self._observe(features, starts)

    def _observe(self, features: dict[int, torch.Tensor], starts: torch.Tensor) -> None:
        graph = self.observe_graphs.get(tuple(features[self.static.drafter.capture_layers[0]].shape[:2]))
        if graph is None:
            self.static.observe(features, starts)
        else:
            graph.replay(features, starts)

    def observe_aside(self, features: dict[int, torch.Tensor], starts: torch.Tensor) -> None:
        """`observe` replayed on the runner's side stream behind the work queued so far; the current
        stream waits only for its input copies (module docstring). Where no graph serves the shape
        (the CPU), the plain `observe`."""
        graph = self.observe_graphs.get(tuple(features[self.static.drafter.capture_layers[0]].shape[:2]))
        if graph is None:
            self.join()
            return self._observe(features, starts)
        main = torch.cuda.current_stream(self.static.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.static.device)
        self._side.wait_stream(main)  # the step that made the features, and every earlier ring write
        copied, self._aside = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(self._side):
            graph.load_inputs(features, starts)
            copied.record()
            graph.graph.replay()
            self._aside.record()
        starts.record_stream(self._side)  # read there: not reused before the copy ran (main waits for it)
        main.wait_event(copied)  # the next step may overwrite the features only after the copies

    def join(self) -> None:
        """Have the current stream wait for the last `observe_aside` (a no-op when none is pending)."""
        if self._aside is not None:
            torch.cuda.current_stream(self.static.device).wait_event(self._aside)
            self._aside = None

    def propose(self, anchors: torch.Tensor, positions: torch.Tensor, width: int | None = None):
        """Greedy blocks of `width` slots (default k) of slots 0 .. b − 1 from device anchors and positions
        [b] (values as `StaticDrafter.plan` checks them): the bucket's graph of that width on CUDA (its
        buffers: copy what must outlive the next call), the eager static propose elsewhere (and for a
        width without a graph). No host read."""
        self.join()
        graph = self.propose_graphs.get((anchors.shape[0], self.static.n_draft if width is None else width))
        if graph is not None:
            return graph.replay(anchors, positions)
        return self.static.propose(anchors, positions, width=width)

    def propose_sampled(self, anchors: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor):
        """k-slot blocks of slots 0 .. b − 1 with per-slot temperatures fp32 [b] (0 = greedy row) and the
        slots' counter-based noise: the bucket's sampled graph on CUDA, the eager static propose
        elsewhere. No host read."""
        self.join()
        return sampled_propose(self, anchors, positions, temperature)

    def draft(self, requests: list) -> tuple[list[list[int]], list, torch.Tensor, list[torch.Tensor]]:
        """One k-slot block per request (each holding a static slot), in one `propose` over the bucket
        of the first b slots that holds them all.

        Returns, in request order: tokens (B lists of k ids), q (fp32 [k, V] on the device for a
        sampled request, None for a greedy one), confidences fp32 [B, k] and raw confidence logits
        (B tensors [k]), both on the host."""
        proposal, rows, tokens, probs, confidence = draft_requests(self, requests)
        logits = proposal.confidence_logits.index_select(0, rows).float().cpu()  # [B, k]
        return tokens, probs, confidence, list(logits)


def sampled_propose(runner, anchors: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor):
    """A drafting runner's sampled propose (`sampled_graphs` on CUDA, else its static drafter's eager
    propose)."""
    if runner.sampled_graphs is not None:
        return runner.sampled_graphs(anchors, positions, temperature)
    return runner.static.propose(anchors, positions, temperature)


def draft_requests(runner, requests: list):
    """The static propose of a drafting runner (`StaticDraftRunner`, `StaticMtpRunner`: `slots`,
    `static`, `propose`, `propose_sampled`) for requests each holding a static slot, over the bucket
    of the first b slots that holds them all: greedy rounds from the bucket's graph (`runner.propose`),
    a round with a sampled request with per-slot temperatures (`runner.propose_sampled`).

    Returns (proposal, rows [B] long on the device: the requests' slots, tokens: B lists of k ids,
    probs: q fp32 [k, V] on the device per sampled request, None per greedy one, confidence fp32
    [B, k] on the host), in request order."""
    b = bucket(max((req.state.slot for req in requests), default=0) + 1, runner.slots)
    anchors, positions, temps = [0] * b, [0] * b, [0.0] * b
    for req in requests:
        slot = req.state.slot
        anchors[slot], positions[slot], temps[slot] = req.out[-1], req.state.length, req.params.temperature
    sampled = any(t > 0 for t in temps)
    anchors, positions, temperature = runner.static.plan(anchors, positions, temps if sampled else None)
    if sampled:
        proposal = runner.propose_sampled(anchors, positions, temperature)
    else:
        proposal = runner.propose(anchors, positions)
    index = [req.state.slot for req in requests]
    rows = torch.tensor(index, dtype=torch.long, device=proposal.tokens.device)  # [B]
    tokens = proposal.tokens.index_select(0, rows).tolist()  # copies out of the graph's buffers
    confidence = proposal.confidence.index_select(0, rows).float().cpu()  # [B, k]
    probs = [None if req.params.greedy else proposal.probs[slot] for req, slot in zip(requests, index)]
    return proposal, rows, tokens, probs, confidence
