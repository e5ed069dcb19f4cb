"""A CUDA stream beside the caller's, for work whose inputs are ready before the caller needs its output.

    aside = Aside()                       # one per op instance or layer: nothing shared between models
    with aside.fork(x.device) as side:    # the side stream waits for what the caller enqueued so far
        launch(...)                       # runs beside what the caller enqueues next
    join(side)                            # the caller's stream waits for it before reading the result

Under CUDA-graph capture the fork and the join become edges of the graph, so a replay keeps the
overlap at no host cost. Allocate what the side work writes (and its temporaries) on the caller's
stream before the fork and keep them alive until the join: the caching allocator then ties their
memory to the caller's stream, which cannot reuse it before it has waited for the side work.
Off CUDA `fork` runs the block inline and yields None, which `join` accepts. torch hands out
`torch.cuda.Stream()`s from a per-device pool, round-robin: many instances (one per MoE layer) may
share one underlying stream, which orders their work without changing any result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class Aside:
    """One side stream per CUDA device, made on first use and owned by this instance."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @contextlib.contextmanager
    def fork(self, device: torch.device) -> Iterator[torch.cuda.Stream | None]:
        """Run the block on the side stream of `device` after everything the current stream has
        enqueued; yields that stream (None off CUDA, where the block runs inline)."""
        device = torch.device(device)
        if device.type != "cuda":
            yield None
            return
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            yield side


def join(side: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for the work forked onto `side` (nothing for None: it ran inline)."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
