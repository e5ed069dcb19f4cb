"""CUDA-graph capture and replay of the static decode / verify step, one graph per (slots b, tokens T).

    decoder = StaticDecoder(model, StaticShape(slots=8, max_context=4096, tokens=4))
    graphs = {(b, t): StepGraph(decoder, t, slots=b) for b in (1, 2, 4, 8) for t in (1, 4)}  # BEFORE loading
    start = decoder.load(slot, state)
    logits = graphs[4, 4].replay(input_ids, starts)        # [4, 4, V] (slots 0..3), the graph's own buffer

A graph replays the kernels recorded at capture on fixed addresses: the inputs are copied into the
graph's static buffers (`input_ids` [b, T], `starts` [b]; a caller that computes them on the device
can write those buffers in place and call `replay()` with no arguments), and the logits land in the
same output tensor every time (clone it to keep it past the next replay). The warm-up step before
capture writes rows of every slot at positions 0 .. T − 1, so capture on a decoder whose slots hold
no request yet. A graph of b < S slots steps the first b slots only (a bucket). Graphs of one
decoder may share a memory pool (`pool`); they share its state.
With `capture_layers`, `output` (a `StaticStepOutput`) also holds the final streams and those
layers' input streams of the last replay, for a drafter to observe.
"""

from __future__ import annotations

import torch


class StepGraph:
    """`decoder.step` captured for T = `tokens` new tokens per slot of the first b = `slots` slots
    (default: all S) (CUDA only)."""

    def __init__(self, decoder, tokens: int, pool=None, capture_layers: tuple[int, ...] = (), slots: int | None = None):
        device = decoder.model.device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, got device {device}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= decoder.shape.tokens:
            raise ValueError(f"tokens={tokens!r} outside [1, {decoder.shape.tokens}] (the decoder's tokens per step)")
        slots = decoder.shape.slots if slots is None else slots
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= decoder.shape.slots:
            raise ValueError(f"slots={slots!r} outside [1, {decoder.shape.slots}] (the decoder's slots)")
        self.decoder = decoder
        self.input_ids = torch.zeros(slots, tokens, dtype=torch.long, device=device)
        self.starts = torch.zeros(slots, dtype=torch.long, device=device)
        # Warm up on a side stream (Triton compiles and autotunes outside the capture), then record.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            decoder.forward(self.input_ids, self.starts, capture_layers)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), torch.no_grad():
            self.output = decoder.forward(self.input_ids, self.starts, capture_layers)
        self.logits = self.output.logits  # [b, T, V] fp32

    def pool(self):
        """The graph's memory pool handle, to share with the decoder's other graphs."""
        return self.graph.pool()

    def replay(self, input_ids: torch.Tensor | None = None, starts: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the inputs (device tensors [b, T] and [b], values as `StaticDecoder.plan` checks them)
        into the static buffers when given, replay, return the logits buffer [b, T, V]."""
        if input_ids is not None:
            if input_ids.shape != self.input_ids.shape:
                raise ValueError(f"input_ids must be {tuple(self.input_ids.shape)}, got {tuple(input_ids.shape)}")
            self.input_ids.copy_(input_ids)
        if starts is not None:
            if starts.shape != self.starts.shape:
                raise ValueError(f"starts must be {tuple(self.starts.shape)}, got {tuple(starts.shape)}")
            self.starts.copy_(starts)
        self.graph.replay()
        return self.logits
