"""CUDA-graph capture and replay of the static DSpark drafter (`static_drafter.py`), one graph per bucket.

    static = StaticDrafter(drafter, StaticDraftShape(slots=8, tokens=drafter.block_size + 1))
    observe = ObserveGraph(static, tokens=6)        # capture BEFORE loading requests (its warm-up writes)
    propose = ProposeGraph(static, pool=observe.pool())   # reads the state only: capture any time
    static.load(slot, dstate, key)
    observe.replay(features, starts)                # writes the rings
    proposal = propose.replay(anchors, positions)   # DraftProposal of the graph's own output buffers

A graph replays the kernels recorded at capture on fixed addresses: the inputs are copied into the
graph's static buffers (a caller that computes them on the device can write those buffers in place
and call `replay()` with no arguments), and the outputs land in the same tensors every time (clone
them to keep them past the next replay). `ProposeGraph` captures greedy drafting (no q);
`SampledProposeGraph` captures any static propose with per-slot temperatures, whose noise is a hash
of the inputs (`dspark.kernels.slot_noise`: each slot's request key and the drafted positions), so a
replay needs no generator state and draws what an eager call would. Graphs of one drafter may share
a memory pool (`pool`). `slots=b`
captures a bucket of the first b slots (default: all S), whose inputs and outputs are [b, ...].
"""

from __future__ import annotations

import torch

from dspark.draft.base import DraftProposal
from dspark.draft.static_drafter import StaticDrafter


def capture_call(device, fn, pool):
    """Warm fn up on a side stream (Triton compiles and autotunes outside the capture), then record it.
    Returns (graph, fn's outputs at capture)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.no_grad():
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.no_grad():
        out = fn()
    return graph, out


def _check_cuda(static: StaticDrafter) -> None:
    if not isinstance(static, StaticDrafter):
        raise ValueError(f"static must be a StaticDrafter, got {type(static).__name__}")
    if static.device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA drafter, got device {static.device}")


def _bucket(static: StaticDrafter, slots: int | None) -> int:
    """b = `slots` (default S), validated against the drafter's S."""
    slots = static.shape.slots if slots is None else slots
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= static.shape.slots:
        raise ValueError(f"slots={slots!r} outside [1, {static.shape.slots}] (the drafter's slots)")
    return slots


def _copy_in(buffer: torch.Tensor, value: torch.Tensor | None, name: str) -> None:
    if value is not None:
        if value.shape != buffer.shape:
            raise ValueError(f"{name} must be {tuple(buffer.shape)}, got {tuple(value.shape)}")
        buffer.copy_(value)


class ProposeGraph:
    """`StaticDrafter.propose` (greedy) of slots 0 .. b − 1 captured: inputs `anchors`, `positions` [b]
    long; output `proposal` (tokens [b, k], confidence and confidence_logits [b, k], probs None; k =
    `width`, default the drafter's `n_draft`, fixed at capture)."""

    def __init__(self, static: StaticDrafter, pool=None, slots: int | None = None, width: int | None = None):
        _check_cuda(static)
        s, device = _bucket(static, slots), static.device
        self.anchors = torch.zeros(s, dtype=torch.long, device=device)
        self.positions = torch.zeros(s, dtype=torch.long, device=device)
        self.graph, self.proposal = capture_call(
            device, lambda: static.propose(self.anchors, self.positions, width=width), pool)

    def pool(self):
        return self.graph.pool()

    def replay(self, anchors: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> DraftProposal:
        """Copy the inputs (device tensors [b], values as `StaticDrafter.plan` checks them) when given,
        replay, return the proposal buffers."""
        _copy_in(self.anchors, anchors, "anchors")
        _copy_in(self.positions, positions, "positions")
        self.graph.replay()
        return self.proposal


class SampledProposeGraph:
    """A static drafter's sampled propose of slots 0 .. b − 1 captured, b = `slots`: `propose(anchors,
    positions, temperature)` (`StaticDrafter.propose`, `StaticMtpDrafter.propose`) with inputs
    `anchors`, `positions` [b] long and `temperature` [b] fp32 (0 = a greedy row); its noise is a hash
    of each slot's noise key and positions (`dspark.kernels.slot_noise`), so a replay draws what an eager
    call at the same inputs would; output `proposal` (tokens, probs [b, k, V] q, confidences).
    Capture any time: propose reads the drafter's state only."""

    def __init__(self, propose, slots: int, device: torch.device, pool=None):
        self.anchors = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
        self.graph, self.proposal = capture_call(
            device, lambda: propose(self.anchors, self.positions, self.temperature), pool)

    def pool(self):
        return self.graph.pool()

    def replay(self, anchors: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor) -> DraftProposal:
        """Copy the inputs (device tensors [b]; values as the drafter's `plan` checks them), replay,
        return the proposal buffers (valid until the next replay)."""
        _copy_in(self.anchors, anchors, "anchors")
        _copy_in(self.positions, positions, "positions")
        _copy_in(self.temperature, temperature, "temperature")
        self.graph.replay()
        return self.proposal


class ObserveGraph:
    """`StaticDrafter.observe` of T = `tokens` rows per slot of slots 0 .. b − 1 captured: inputs
    `features` {layer: [b, T, n_hc, D]} (the target's dtype) and `starts` [b] long. The warm-up
    writes positions 0 .. T − 1 of those slots: capture before loading requests."""

    def __init__(self, static: StaticDrafter, tokens: int, pool=None, slots: int | None = None):
        _check_cuda(static)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= static.shape.tokens:
            raise ValueError(f"tokens={tokens!r} outside [1, {static.shape.tokens}] (the bucket's rows per observe)")
        s, device, target = _bucket(static, slots), static.device, static.drafter.target
        width = (target.config.hc_mult, target.config.hidden_size)
        self.features = {i: torch.zeros(s, tokens, *width, dtype=target.dtype, device=device)
                         for i in static.drafter.capture_layers}
        self.starts = torch.zeros(s, dtype=torch.long, device=device)
        self.graph, _ = capture_call(device, lambda: static.observe(self.features, self.starts), pool)

    def pool(self):
        return self.graph.pool()

    def load_inputs(self, features: dict[int, torch.Tensor] | None = None, starts: torch.Tensor | None = None) -> None:
        """Copy the inputs given into the graph's buffers (queued on the current stream)."""
        if features is not None:
            for i, buffer in self.features.items():
                if i not in features:
                    raise ValueError(f"features lack target layer {i}")
                _copy_in(buffer, features[i], f"features[{i}]")
        _copy_in(self.starts, starts, "starts")

    def replay(self, features: dict[int, torch.Tensor] | None = None, starts: torch.Tensor | None = None) -> None:
        self.load_inputs(features, starts)
        self.graph.replay()
