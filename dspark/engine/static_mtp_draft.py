"""The engine's MTP drafting on the static slots (`static_decode` with an `MtpDrafter`).

    drafting = StaticMtpRunner(drafter, slots=64, max_context=8192, tokens=2)   # before any request is loaded
    drafting.load(slot, req.dstate, length, key)   # at the request's first round, with its target state
    tokens, probs, conf, logits = drafting.draft(requests)   # what `dspark.round._draft` returns
    runner.forward(requests, blocks, drafter, observe=drafting.observe)   # every slot's verify rows

The `StaticDraftRunner` of the MTP block (`dspark.draft.static_mtp`): a request drafts from the slot
with its target slot's number, one `propose` over the bucket of the first b slots serves every live
request, and `observe` takes all t rows of every bucket slot of a verify step (the final streams,
which the target step returns as the features of layer `num_hidden_layers`: `capture_layers`, its
starts and its tokens); the next anchor position hides the rows past the committed ones.

On CUDA the greedy `propose` of each bucket b and the `observe` of each (b, t), t = 1 .. T, are CUDA
graphs (`MtpProposeGraph`, `MtpObserveGraph`, captured here before any request is loaded: their
warm-ups write every slot). A round with any sampled request runs the sampled static `propose` for
the whole batch, with per-slot temperatures and each slot's counter-based noise, as the DSpark
runner does (on CUDA from a graph per bucket captured at its first sampled round; `static_draft.py`
says why outputs stay exact and depend on a request's seed alone).

Shape symbols: S slots, b a call's bucket, T rows per verify step at most, t this step's, k block
size, V vocabulary, n_hc streams, D hidden size, B live requests.
"""

from __future__ import annotations

import torch

from dspark.draft.base import DraftProposal
from dspark.draft.mtp import MtpDrafter, MtpState
from dspark.draft.static_graph import capture_call
from dspark.draft.static_mtp import StaticMtpDrafter
from dspark.engine.slots import buckets
from dspark.engine.static_draft import SampledGraphs, draft_requests, sampled_propose
from dspark.models.deepseek_v4.static_state import StaticShape


class MtpProposeGraph:
    """`StaticMtpDrafter.propose` (greedy) of slots 0 .. b − 1 captured: inputs `anchors`, `positions`
    [b] long; output `proposal` (tokens [b, k], confidence [b, k], probs None)."""

    def __init__(self, static: StaticMtpDrafter, slots: int, pool=None):
        self.anchors = torch.zeros(slots, dtype=torch.long, device=static.device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=static.device)
        self.graph, self.proposal = capture_call(static.device, lambda: static.propose(self.anchors, self.positions),
                                                 pool)

    def replay(self, anchors: torch.Tensor, positions: torch.Tensor) -> DraftProposal:
        self.anchors.copy_(anchors)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.proposal


class MtpObserveGraph:
    """`StaticMtpDrafter.observe` of t = `tokens` rows per slot of slots 0 .. b − 1 captured: inputs
    `hidden` [b, t, n_hc, D] (the target's dtype), `starts` [b], `ids` [b, t]. The warm-up writes
    positions 0 .. t − 1 of those slots: capture before loading requests."""

    def __init__(self, static: StaticMtpDrafter, slots: int, tokens: int, pool=None):
        target, device = static.target, static.device
        width = (target.config.hc_mult, target.config.hidden_size)
        self.hidden = torch.zeros(slots, tokens, *width, dtype=target.dtype, device=device)
        self.starts = torch.zeros(slots, dtype=torch.long, device=device)
        self.ids = torch.zeros(slots, tokens, dtype=torch.long, device=device)
        self.graph, _ = capture_call(device, lambda: static.observe(self.hidden, self.starts, self.ids), pool)

    def replay(self, hidden: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor) -> None:
        self.hidden.copy_(hidden)
        self.starts.copy_(starts)
        self.ids.copy_(ids)
        self.graph.replay()


class StaticMtpRunner:
    """A `StaticMtpDrafter` over `slots` slots of `max_context` target positions taking up to `tokens`
    rows per observe, with its CUDA graphs."""

    def __init__(self, drafter: MtpDrafter, slots: int, max_context: int, tokens: int):
        self.static = StaticMtpDrafter(drafter, StaticShape(slots, max_context, tokens))
        device = self.static.device
        # The target step hands its final streams over as the features of this layer id.
        self.capture_layers = (drafter.target.config.num_hidden_layers,)
        self.observe_graphs: dict[tuple[int, int], MtpObserveGraph] = {}  # (b, t) -> graph
        self.propose_graphs: dict[int, MtpProposeGraph] = {}  # b -> graph
        self.sampled_graphs = SampledGraphs(self.static.propose, device) if device.type == "cuda" else None
        if device.type == "cuda":  # before any request is loaded: the warm-ups write every slot
            pool = None
            for b in buckets(slots):
                for t in range(1, tokens + 1):
                    graph = self.observe_graphs[b, t] = MtpObserveGraph(self.static, b, t, pool=pool)
                    pool = graph.graph.pool()
                self.propose_graphs[b] = MtpProposeGraph(self.static, b, pool=pool)

    @property
    def slots(self) -> int:
        return self.static.shape.slots

    def load(self, slot: int, dstate: MtpState, length: int, key: int = 0) -> None:
        """Copy a request's dynamic MTP state and noise key into `slot`; `length` is its target length
        (the position of its next anchor), which the MTP state must have reached too."""
        drafted = self.static.load(slot, dstate, key)
        if drafted != length:
            raise RuntimeError(f"slot {slot}: the MTP state pairs {drafted} positions but the target holds {length}")

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s MTP state (with its target slot; between rounds)."""
        self.static.move(src, dst)

    def observe(self, features: dict[int, torch.Tensor], starts: torch.Tensor, ids: torch.Tensor) -> None:
        """Every bucket slot's rows of one verify step: features {num_hidden_layers: [b, t, n_hc, D]},
        starts long [b], ids long [b, t] (device tensors, the target step's own)."""
        hidden = features[self.capture_layers[0]]
        graph = self.observe_graphs.get(tuple(ids.shape))
        if graph is None:
            self.static.observe(hidden, starts, ids)
        else:
            graph.replay(hidden, starts, ids)

    def propose(self, anchors: torch.Tensor, positions: torch.Tensor, width: int | None = None) -> DraftProposal:
        """Greedy k-blocks of slots 0 .. b − 1 from device anchors and positions [b]: the bucket's graph
        on CUDA (its buffers: copy what must outlive the next call), the eager static propose elsewhere.
        `width`: as `StaticDraftRunner.propose`'s, but an MTP block is drafted whole (None or k)."""
        k = self.static.drafter.block_size
        if width not in (None, k):
            raise ValueError(f"width: an MTP runner drafts its whole block of {k}, got {width!r}")
        graph = self.propose_graphs.get(anchors.shape[0])
        return graph.replay(anchors, positions) if graph is not None else self.static.propose(anchors, positions)

    def propose_sampled(self, anchors: torch.Tensor, positions: torch.Tensor,
                        temperature: torch.Tensor) -> DraftProposal:
        """k-blocks of slots 0 .. b − 1 with per-slot temperatures fp32 [b] (0 = greedy row): the
        bucket's sampled graph on CUDA, the eager static propose elsewhere."""
        return sampled_propose(self, anchors, positions, temperature)

    def draft(self, requests: list) -> tuple[list[list[int]], list, torch.Tensor, list[None]]:
        """One k-block per request (each holding a static slot), in one `propose` over the bucket of the
        first b slots that holds them all.

        Returns, in request order: tokens (B lists of k ids), q (fp32 [k, V] on the device for a sampled
        request, None for a greedy one), confidences fp32 [B, k] on the host and B None (no confidence
        head: what the dynamic `_draft` gives for MTP)."""
        _, _, tokens, probs, confidence = draft_requests(self, requests)
        return tokens, probs, confidence, [None] * len(requests)
