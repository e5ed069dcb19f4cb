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

Single-row observes are deferred. A verify step of one row per slot (a plain round of "auto",
synchronous or in flight, or a batch at its budget caps) commits the row it feeds, each slot's anchor,
so `observe` only copies that row of each captured layer into the inputs of the (b, T) observe, as row
j of a run of such steps (positions: the run's first starts + j), and replays that one observe when T
rows wait or before anything else touches the rings (`flush`: a wider observe, propose, load, move, a
bucket change, a dropped round in flight). A flush also writes the older rows j .. T − 1 of the
inputs, at positions past every committed length, which the rollback rule hides as it hides a rejected
draft. A plain round so costs a copy per captured layer instead of an observe graph (dspark-tiny on
one H200, sampled, four requests: the auto engine's device time per step over a plain engine's went
from +107 to +59 µs, its plain rounds from 1.17x to 1.11x a plain engine's; `bench/README.md`,
twenty-first session).
Positions stay consecutive within a run: a one-row step advances each live request by exactly its
anchor, and whatever else moves a slot's position flushes first; free slots of the bucket get rows at
0 .. T − 1, as any T-row step gives them. Every plain row is computed in the same (b, T) call,
however the run ends, so the synchronous engine and the round in flight keep bit-equal contexts.

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
        self._pending: tuple[int, int] | None = None  # deferred one-row observes: (bucket b, rows j) waiting
        self._buffers: dict[int, tuple[dict[int, torch.Tensor], torch.Tensor]] = {}  # b -> eager buffers (no graph)
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

    @property
    def tokens(self) -> int:
        """T, rows per slot of one observe at most."""
        return self.static.shape.tokens

    def load(self, slot: int, dstate: DSparkState, length: int, key: int = 0) -> None:
        """Copy a request's dynamic draft state and noise key into `slot`; `length` is its target
        length (the position of its next anchor), which the draft state must have reached too."""
        self.flush()
        drafted = self.static.load(slot, dstate, key)
        if drafted != length:
            raise RuntimeError(f"slot {slot}: the draft state holds {drafted} positions but the target {length}")

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s draft state (with its target slot; between rounds)."""
        self.flush()
        self.static.move(src, dst)

    def observe(self, features: dict[int, torch.Tensor], starts: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        """Every bucket slot's rows of one verify step: features {layer: [b, t, n_hc, D]}, starts long
        [b] (device tensors, the target step's own); the step's ids [b, t] are not needed (DSpark's
        context keys come from the features alone). A one-row step (t = 1) is deferred (module
        docstring): its rows reach the drafter's state at the next `flush`."""
        b, t = features[self.static.drafter.capture_layers[0]].shape[:2]
        if t == 1:
            return self._defer(features, starts, b)
        self.flush()
        self._observe(features, starts)

    def _defer(self, features: dict[int, torch.Tensor], starts: torch.Tensor, b: int) -> None:
        """Copy a one-row step's rows into row j of the (b, T) observe's inputs; replay it at T rows."""
        if self._pending is not None and self._pending[0] != b:
            self.flush()
        j = 0 if self._pending is None else self._pending[1]
        inputs, first = self._inputs(b)
        if j == 0:
            first.copy_(starts)
        for i, buffer in inputs.items():
            buffer[:, j].copy_(features[i][:, 0])
        self._pending = (b, j + 1)
        if j + 1 == self.tokens:
            self.flush()

    def _inputs(self, b: int) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """The (b, T) observe's inputs ({layer: [b, T, n_hc, D]}, starts [b]): its graph's buffers on
        CUDA, buffers of their own (made at the bucket's first deferred row) elsewhere."""
        graph = self.observe_graphs.get((b, self.tokens))
        if graph is not None:
            return graph.features, graph.starts
        if b not in self._buffers:
            target = self.static.drafter.target
            shape = (b, self.tokens, target.config.hc_mult, target.config.hidden_size)
            self._buffers[b] = ({i: torch.zeros(shape, dtype=target.dtype, device=self.static.device)
                                 for i in self.static.drafter.capture_layers},
                                torch.zeros(b, dtype=torch.long, device=self.static.device))
        return self._buffers[b]

    def flush(self) -> None:
        """Observe the deferred rows (a no-op when none wait): one (b, T) observe from the run's first
        starts; its rows past the run lie past every committed length (module docstring)."""
        if self._pending is None:
            return
        b, _ = self._pending
        self._pending = None
        graph = self.observe_graphs.get((b, self.tokens))
        if graph is not None:
            graph.graph.replay()  # its inputs are the buffers the deferred rows were copied into
        else:
            self.static.observe(*self._inputs(b))

    def _observe(self, features: dict[int, torch.Tensor], starts: torch.Tensor) -> None:
        graph = self.observe_graphs.get(tuple(features[self.static.drafter.capture_layers[0]].shape[:2]))
        if graph is None:
            self.static.observe(features, starts)
        else:
            graph.replay(features, starts)

    def propose(self, anchors: torch.Tensor, positions: torch.Tensor, width: int | None = None):
        """Greedy blocks of `width` slots (default k) of slots 0 .. b − 1 from device anchors and positions
        [b] (values as `StaticDrafter.plan` checks them): the bucket's graph of that width on CUDA (its
        buffers: copy what must outlive the next call), the eager static propose elsewhere (and for a
        width without a graph). No host read."""
        self.flush()
        graph = self.propose_graphs.get((anchors.shape[0], self.static.n_draft if width is None else width))
        if graph is not None:
            return graph.replay(anchors, positions)
        return self.static.propose(anchors, positions, width=width)

    def propose_sampled(self, anchors: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor):
        """k-slot blocks of slots 0 .. b − 1 with per-slot temperatures fp32 [b] (0 = greedy row) and the
        slots' counter-based noise: the bucket's sampled graph on CUDA, the eager static propose
        elsewhere. No host read."""
        self.flush()
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
