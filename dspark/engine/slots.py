"""Host-side bookkeeping of the static decode slots (no device): who holds which slot, and how long
each slot's sequence is.

With `EngineConfig.static_decode`, a request that has finished its (dynamic) prefill moves into one
of a fixed pool of slots of a `StaticDecoder`; its decode state then lives in the decoder's buffers
and the request keeps only a `SlotState` (slot number and length), which the round reads and
rewinds exactly like a `DecodeState`. A finished, aborted or preempted request gives its slot back.
"""

from __future__ import annotations


class SlotTable:
    """A fixed pool of `slots` slot numbers, handed out lowest first, keyed by request id."""

    def __init__(self, slots: int):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive int, got {slots!r}")
        self.slots = slots
        self._free = list(range(slots))
        self._held: dict[str, int] = {}

    def assign(self, request_id: str) -> int:
        """A free slot for `request_id` (which must hold none); RuntimeError when all are taken."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds slot {self._held[request_id]}")
        if not self._free:
            raise RuntimeError(f"all {self.slots} slots are taken; the engine runs at most max_running requests")
        self._free.sort()  # lowest first keeps the live slots packed towards 0
        slot = self._free.pop(0)
        self._held[request_id] = slot
        return slot

    def release(self, request_id: str) -> int | None:
        """Give back the slot of `request_id`; returns it, or None if the request held none."""
        slot = self._held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def holder_slots(self) -> dict[str, int]:
        """request id -> slot, a copy."""
        return dict(self._held)

    @property
    def free(self) -> int:
        return len(self._free)


class SlotState:
    """A request's decode state while it lives in static slot `slot`: only its length, on the host.

    Duck-types the part of `DecodeState` a round uses: `length` (tokens fed) and `truncate(n)`, which
    rolls back to any length between the start and the end of the last target call (the static
    state's rule); the runner calls `advance` for every call.
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
