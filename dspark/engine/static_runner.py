"""The engine's decode / verify target calls on a `StaticDecoder` / `StaticDecoderV41` (CUDA-graph replays on CUDA).

    runner = StaticRunner(model, slots=64, max_context=8192, tokens=4, capture_layers=(1, 5))
    req.state = SlotState(slot, runner.load(slot, req.state))  # after the request's dynamic prefill
    out, offsets = runner.forward(requests, blocks, drafter)   # what `dspark.round._forward` returns

A step runs the first b slots (a bucket: b = the next power of two above the highest slot fed, at
most S; `dspark.engine.slots.bucket`) with t tokens each, t = the longest block of the call
(1 ≤ t ≤ T): a request's block of n ≤ t tokens fills the first n rows of its slot, the other
t − n rows get token 0 and their logits are dropped (their state rows lie past the request's
length, so the next call overwrites them: the rollback rule of `static_state.py`); a slot of the
bucket with no request is fed token 0 at position 0. Every slot below b that holds a request must
therefore be in every call; slots >= b are not touched. The engine keeps the live slots at
0 .. n − 1 (`move`), so b is the bucket of n. The rows of the requests are gathered back into the
ragged order of the dynamic path, so the round is unchanged.

On CUDA the step is captured once per (b, t), b in `buckets(S)`, t = 1 .. T (`StepGraph`, one shared
memory pool), before any request is loaded (the warm-up steps write every slot); on other devices it
runs eagerly. So a round over few requests runs on few slots, and one that verifies fewer drafts (a
smaller budget from the planner) runs a narrower step. This module is the only part of the static
path that touches the device; slot numbers and lengths are kept on the host (`dspark.engine.slots`).

Shape symbols: S slots, b this step's bucket, T tokens per step at most, t this step's, N rows of
the requests' blocks, V vocab, n_hc streams, D hidden size.
"""

from __future__ import annotations

import torch

from dspark.engine.graphs import StepGraph
from dspark.engine.slots import SlotState, bucket, buckets
from dspark.models.deepseek_v4.model import DeepseekV4Output
from dspark.models.deepseek_v4.static_state import StaticShape
from dspark.models.deepseek_v4.static_step import StaticDecoder
from dspark.models.deepseek_v41.model import DeepseekV41ForCausalLM
from dspark.models.deepseek_v41.static_step import StaticDecoderV41


class StaticRunner:
    """Static decode / verify calls of `model` over `slots` slots of `max_context` positions, at most
    `tokens` per request per call, returning the input streams of `capture_layers` for a drafter."""

    def __init__(self, model, slots: int, max_context: int, tokens: int, capture_layers: tuple[int, ...] = ()):
        self.model = model
        decoder = StaticDecoderV41 if isinstance(model, DeepseekV41ForCausalLM) else StaticDecoder
        self.decoder = decoder(model, StaticShape(slots, max_context, tokens))
        self.capture = tuple(sorted(set(capture_layers)))
        self.graphs: dict[tuple[int, int], StepGraph] = {}  # (b, t) -> graph
        if model.device.type == "cuda":  # before any request is loaded: the warm-up steps write every slot
            pool = None
            for b in buckets(slots):
                for t in range(1, tokens + 1):
                    graph = self.graphs[b, t] = StepGraph(self.decoder, t, pool=pool, capture_layers=self.capture,
                                                          slots=b)
                    pool = graph.pool()

    @property
    def shape(self) -> StaticShape:
        return self.decoder.shape

    def load(self, slot: int, state) -> int:
        """Copy a request's dynamic `DecodeState` into `slot`; returns its length (next start)."""
        return self.decoder.load(slot, state)

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s request (the slot table's compaction; between rounds)."""
        self.decoder.move(src, dst)

    def forward(self, requests: list, blocks: list[list[int]], drafter=None,
                observe=None) -> tuple[DeepseekV4Output, list[int]]:
        """Feed `blocks[b]` to request b (whose `state` is a `SlotState`) in one static step.

        Returns the ragged output of the dynamic path: logits fp32 [N, V], final streams [N, n_hc, D]
        and features {layer: [N, n_hc, D]} of the requests' rows in order, and each request's first
        row. Advances every request's `SlotState` by its block (roll back with `truncate`).
        `observe(features {layer: [b, t, n_hc, D]}, starts [b], ids [b, t])`, when given, gets every
        bucket slot's rows of the step before the gather (the static drafter's `observe`; device
        tensors, no host read), and the features are not gathered (returned as {}: the drafter has
        them all, and a gather per captured layer adds launches that a small model's round feels).
        """
        missing = set(drafter.capture_layers if drafter is not None else ()) - set(self.capture)
        if missing:
            raise ValueError(f"the drafter observes layers {sorted(missing)} that the static step does not "
                             f"capture (capture_layers={self.capture})")
        tokens = max((len(b) for b in blocks), default=1)
        if tokens > self.shape.tokens:
            raise ValueError(f"a block of {tokens} tokens; the static step takes at most {self.shape.tokens}")
        for req in requests:
            if not isinstance(req.state, SlotState):
                raise ValueError(f"request {req.request_id!r} holds no static slot (state {type(req.state).__name__})")
        slots = bucket(max((req.state.slot for req in requests), default=0) + 1, self.shape.slots)
        # Host lists, one tensor each at the end (a tensor write per request costs more than the list).
        ids = [[0] * tokens for _ in range(slots)]  # [b, t]; padding rows: token 0
        starts = [0] * slots  # [b]; free slots: position 0
        rows, offsets, seen = [], [], set()
        for req, block in zip(requests, blocks):
            state = req.state
            if not block:
                raise ValueError(f"request {req.request_id!r}: empty block")
            if state.slot in seen:
                raise ValueError(f"slot {state.slot} fed twice in one call")
            seen.add(state.slot)
            ids[state.slot][: len(block)] = block
            starts[state.slot] = state.length
            offsets.append(len(rows))
            rows.extend(range(state.slot * tokens, state.slot * tokens + len(block)))
        ids, starts = self.decoder.plan(ids, starts)
        out = self.step(ids, starts)
        if observe is not None:
            observe(out.features, starts, ids)
        for req, block in zip(requests, blocks):  # after `plan` accepted the positions
            req.state.advance(len(block))
        index = torch.tensor(rows, dtype=torch.long).to(self.model.device, non_blocking=True)  # [N]

        def gather(t: torch.Tensor) -> torch.Tensor:  # [b, t, ...] -> [N, ...] rows of the requests
            return t.flatten(0, 1).index_select(0, index)

        features = {} if observe is not None else {i: gather(f) for i, f in out.features.items()}
        return DeepseekV4Output(gather(out.logits), gather(out.hidden), features), offsets

    def launch(self, ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """One step on device inputs (ids [b, t], starts [b], values the caller derived on the device,
        e.g. the previous step's argmax; `dspark.engine.lookahead`): the logits [b, t, V] fp32, the
        graph's buffer (read or copy them before the next call). Touches no host value."""
        return self.step(ids, starts).logits

    def step(self, ids: torch.Tensor, starts: torch.Tensor):
        """ids [b, t], starts [b] on the device -> the step's `StaticStepOutput` (logits [b, t, V], final
        streams, the captured layers' features: a graph's buffers; `dspark.engine.draft_lookahead`).
        Touches no host value."""
        graph = self.graphs.get(tuple(ids.shape))
        if graph is None:
            return self.decoder.forward(ids, starts, self.capture)
        graph.replay(ids, starts)
        return graph.output
