"""One decode step in flight while the host commits the previous one (plain greedy decoding, static slots).

    lookahead = Lookahead(runner)                 # the engine's `StaticRunner`
    tokens = lookahead.step(requests)             # next greedy token per request, in request order
    lookahead.discard()                           # when the batch changes outside a step

A plain greedy step's input is the previous step's argmax, which the device already has. So after
launching step k, `step` launches step k + 1 on the device's own argmax (ids = argmax of step k
at each request's slot, starts + 1) *before* it reads step k's tokens; the host then waits for step
k only (an event recorded after step k's argmax and its copy to the host) and commits them while
the GPU runs step k + 1: the host work of a step (commit, stop checks, events, scheduling) overlaps
the next step instead of leaving the GPU idle. The next call finds step k + 1 already in flight for
the same requests at the expected positions and launches k + 2 the same way.

The step in flight is a guess that the batch stays the same. When it does not (a request finished,
was aborted or preempted, a new one joined, a slot moved, or the round needs drafting or sampling),
its key no longer matches the requests' committed positions and it is dropped: its rows lie past
every request's committed length, which the static state's position rule hides and the next step
overwrites (the same rule as a rejected draft), so dropping it changes no result, only wastes its
GPU time. Output is token-identical to the synchronous engine (tests/engine/test_engine_lookahead.py).

Host syncs: one per step (the event of the step whose tokens are read), none on the step in flight.
On the CPU everything runs eagerly and in order (the logic is the same, the overlap is not).

Shape symbols: b the step's bucket of slots, n requests, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.engine.slots import bucket
from dspark.sampling import greedy

Key = tuple[tuple[str, int, int], ...]  # (request id, slot, start position) of each request, in order


@dataclass
class InFlight:
    """A launched step: what it fed and its argmax, copied to the host behind `event`."""

    key: Key
    live: torch.Tensor  # [b] bool on the device: slots that hold one of the requests
    starts: torch.Tensor  # [b] long on the device: positions fed (free slots: 0)
    argmax: torch.Tensor  # [b] long on the device: the step's greedy token per slot
    host: torch.Tensor  # [b] long on the host (pinned on CUDA): argmax, valid once `event` completed
    event: torch.cuda.Event | None

    def tokens(self) -> list[int]:
        """The step's greedy token of each slot [b]; waits for this step only."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class Lookahead:
    """Greedy plain-decoding steps over a `StaticRunner`, one step ahead (module docstring)."""

    def __init__(self, runner):
        self.runner = runner
        self.pending: InFlight | None = None

    def discard(self) -> None:
        """Forget the step in flight (its rows are invisible past every committed length)."""
        self.pending = None

    def step(self, requests: list) -> list[int]:
        """The next greedy token of every request (each holding a static slot; `req.state.length` =
        tokens fed, `req.out[-1]` = the token to feed now); launches the step after it before reading.
        Does not advance the requests' states: the caller commits."""
        key: Key = tuple((r.request_id, r.state.slot, r.state.length) for r in requests)
        current = self.pending if self.pending is not None and self.pending.key == key else None
        if current is None:
            current = self._launch_from_host(requests, key)
        self.pending = self._launch_next(current)
        tokens = current.tokens()
        return [tokens[slot] for _, slot, _ in key]

    def _launch_from_host(self, requests: list, key: Key) -> InFlight:
        """Step k from host values: each request's last token at its length (the runner's checks)."""
        b = bucket(max(slot for _, slot, _ in key) + 1, self.runner.shape.slots)
        ids, starts, live = [[0] for _ in range(b)], [0] * b, [False] * b
        for req, (_, slot, start) in zip(requests, key):
            ids[slot][0], starts[slot], live[slot] = req.out[-1], start, True
        ids, starts = self.runner.decoder.plan(ids, starts)
        return self._launch(key, ids, starts, torch.tensor(live).to(starts.device, non_blocking=True))

    def _launch_next(self, previous: InFlight) -> InFlight:
        """Step k + 1 from step k's device argmax: the same slots, one position further; no host value."""
        key = tuple((rid, slot, start + 1) for rid, slot, start in previous.key)
        ids = torch.where(previous.live, previous.argmax, 0).unsqueeze(-1)  # [b, 1]
        starts = torch.where(previous.live, previous.starts + 1, 0)
        return self._launch(key, ids, starts, previous.live)

    def _launch(self, key: Key, ids: torch.Tensor, starts: torch.Tensor, live: torch.Tensor) -> InFlight:
        logits = self.runner.launch(ids, starts)  # [b, 1, V], the graph's buffer: argmax before the next replay
        argmax = greedy(logits[:, 0])  # [b]; ties to the lowest id, as `verify_greedy`
        event = None
        if argmax.device.type == "cuda":
            host = torch.empty(argmax.shape, dtype=argmax.dtype, pin_memory=True)
            host.copy_(argmax, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = argmax
        return InFlight(key, live, starts, argmax, host, event)
