"""A second CUDA stream for the parts of a static step that do not depend on each other.

    side = SideStream(device)                # once per decoder (None-like on the CPU)
    with side.fork():                        # enqueued after everything the current stream has so far
        update_compressor(...)               # runs beside what the current stream enqueues next
    q = project_q(...)                       # current stream
    side.join()                              # the current stream waits for the side's work
    attend(q, entries)

At one decode token a layer's kernels are latency-bound (a few µs each, most SMs idle), and its
compressors (projection, pooling, norm: three launches each, two on a CSA layer) need only the
sublayer input, as do the q and kv projections beside them. In one stream every launch waits for the
one before it; forked onto a side stream, the compressors' launches overlap the projections'. Under
CUDA-graph capture the fork and the join become edges of the graph (a branch), so the replay keeps
the overlap at no host cost. The math is unchanged: each kernel reads and writes what it did in one
stream, so the step's results are the same bits.

Memory: tensors the side's work allocates belong to the side stream's pool and are only used there
(its results go into the decoder's persistent state); tensors of the current stream that the side
reads (the sublayer input) stay referenced until after the join.

On the CPU (or with `enabled=False`, the single-stream step a bench compares with) `fork` runs its
block inline and `join` does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class SideStream:
    """A side stream of `device` (module docstring); inline where there is none."""

    def __init__(self, device: torch.device, enabled: bool = True):
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the block's work on the side stream, after what the current stream has enqueued."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """Make the current stream wait for everything forked so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
