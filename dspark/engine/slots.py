"""Host-side bookkeeping of the static decode slots (no device): who holds which slot, and how long
each slot's sequence is.

With `EngineConfig.static_decode`, a request that has finished its (dynamic) prefill moves into one
of a fixed pool of slots of a `StaticDecoder`; its decode state then lives in the decoder's buffers
and the request keeps only a `SlotState` (slot number and length), which the round reads and
rewinds exactly like a `DecodeState`. A finished, aborted or preempted request gives its slot back.

The table keeps the n held slots compact, 0 .. n − 1, so that a step can run on the first
b >= n slots only (a bucket): a new request takes slot n, and when the request in slot i < n − 1
leaves, the one in slot n − 1 moves to slot i. `release` returns that move (`SlotMove`); the caller
copies the slot's device rows (`move(src, dst)` of the static states) and updates the request's
`SlotState.slot`, between rounds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotMove:
    """Request `request_id` moves from slot `src` (the last held) to slot `dst` (just freed)."""

    request_id: str
    src: int
    dst: int


class SlotTable:
    """A fixed pool of `slots` slot numbers keyed by request id; the held ones are always 0 .. n − 1."""

    def __init__(self, slots: int):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive int, got {slots!r}")
        self.slots = slots
        self._holders: list[str] = []  # slot i -> request id, i < n

    def assign(self, request_id: str) -> int:
        """Slot n for `request_id` (which must hold none); RuntimeError when all are taken."""
        if request_id in self._holders:
            raise ValueError(f"request {request_id!r} already holds slot {self._holders.index(request_id)}")
        if len(self._holders) == self.slots:
            raise RuntimeError(f"all {self.slots} slots are taken; the engine runs at most max_running requests")
        self._holders.append(request_id)
        return len(self._holders) - 1

    def release(self, request_id: str) -> SlotMove | None:
        """Give back the slot of `request_id` (nothing if it holds none). Returns the move that keeps
        the held slots compact, or None when the released slot was the last one (or none was held)."""
        if request_id not in self._holders:
            return None
        slot = self._holders.index(request_id)
        last = self._holders.pop()
        if slot == len(self._holders):
            return None
        self._holders[slot] = last
        return SlotMove(last, len(self._holders), slot)

    def holder_slots(self) -> dict[str, int]:
        """request id -> slot, a copy."""
        return {rid: slot for slot, rid in enumerate(self._holders)}

    @property
    def held(self) -> int:
        """n: the held slots are 0 .. n − 1."""
        return len(self._holders)

    @property
    def free(self) -> int:
        return self.slots - len(self._holders)


def bucket(n: int, slots: int) -> int:
    """The slots a step over n live slots runs on: the next power of two >= n, at most `slots`."""
    return min(1 << max(n - 1, 0).bit_length(), slots)


def buckets(slots: int) -> list[int]:
    """Every bucket of a pool of `slots`: 1, 2, 4, ... and `slots` itself."""
    return sorted({bucket(n, slots) for n in range(1, slots + 1)})


class SlotState:
    """A request's decode state while it lives in static slot `slot`: only its length, on the host.

    Duck-types the part of `DecodeState` a round uses: `length` (tokens fed) and `truncate(n)`, which
    rolls back to any length between the start and the end of the last target call (the static
    state's rule); the runner calls `advance` for every call. The engine changes `slot` when the
    table compacts (`SlotMove`).
    """

    def __init__(self, slot: int, length: int):
        self.slot = slot
        self.length = length
        self.rewind_floor = length

    def advance(self, tokens: int) -> int:
        """A target call feeds `tokens` rows from the current length; returns that start."""
        start = self.rewind_floor = self.length
        self.length += tokens
        return start

    def truncate(self, length: int) -> None:
        if not self.rewind_floor <= length <= self.length:
            raise ValueError(f"slot {self.slot}: truncate({length}) outside [{self.rewind_floor}, {self.length}] "
                             f"(the last call's start and end)")
        self.length = length
