"""Which requests run each step: admission, state growth and preemption (host-side, no device).

Policy, applied before every engine step:

1. **Settle.** Every running request's pages shrink to what its state holds now (rejected drafts
   of the last verify, pruned window rows), so freed pages count before anyone grows; of each kind
   it keeps those its next call will need anyway (`StateAllocator.settle`). Releasing them only for
   step 2 to take them back would cost host time at every step where the widest call crosses a page
   boundary that the settled state does not (e.g. the plain rounds of an engine that may verify γ
   drafts), and it decides nothing: victims (step 3) go newest first and release all they hold, so
   the running set ends as the longest prefix, in admission order, whose next calls fit the pool,
   whatever each request held in between.
2. **Grow, oldest first.** Each running request, in admission order, gets the pages its next call
   needs: a prefill call of up to `prefill_chunk` prompt tokens, or a verify call of its anchor
   plus the most drafts it may verify (`verify_width`, capped by the tokens it may still emit).
3. **Preempt, newest first.** When growth fails, the most recently admitted running request is
   preempted, and growth is retried, until it succeeds (the growing request itself goes last).
   Preemption is by recomputation: the request's pages and its device state (target and draft)
   are dropped, and it returns to the *front* of the queue with its output so far kept. Its prompt
   for the new prefill is the original prompt plus every committed token except the last, which
   stays the anchor of its next round; when that prefill completes it resumes decoding without
   sampling anything. Its generator is untouched, so its output is what it would have been without
   the preemption (up to float rounding of a state rebuilt in different chunks).
4. **Admit, FIFO.** Unless this step preempted (memory is short: re-admitting the victim at once
   would only thrash), waiting requests join in order while fewer than `max_running` run and the
   pool has the pages for their first prefill call; admission never preempts, and the queue head
   blocks the ones behind it (no overtaking, so no starvation).

Newest-first keeps the oldest requests, which hold the most computed state and are closest to
finishing, running; the oldest request can always grow because a request is only accepted when
it fits the whole budget alone (`Scheduler.fits`), so the engine always makes progress.
"""

from __future__ import annotations

from collections import deque

from dspark.engine.pages import StateAllocator
from dspark.request import Request


class Scheduler:
    """Waiting queue, running set and the state pages they hold.

    Parameters
    ----------
    allocator : pages of every kind of per-request state, over the engine's memory budget.
    max_running : requests decoded together.
    prefill_chunk : prompt tokens per request per prefill call.
    verify_width : target rows of one verify call at most (1 + the largest verification budget).
    """

    def __init__(self, allocator: StateAllocator, max_running: int, prefill_chunk: int, verify_width: int):
        self.allocator = allocator
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.verify_width = verify_width
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # -- sizes ---------------------------------------------------------------------------------

    def next_call(self, req: Request) -> tuple[int, int]:
        """(length after, tokens fed) of the request's next target call."""
        if req.in_prefill:
            fed = min(self.prefill_chunk, len(req.feed) - req.prefilled)
            return req.prefilled + fed, fed
        fed = min(self.verify_width, req.remaining)
        return req.fed_length + fed, fed

    def fits(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """Whether a request this large can ever run: alone, at its longest, in its widest call."""
        return self.allocator.fits_alone(prompt_tokens + max_new_tokens, max(self.prefill_chunk, self.verify_width))

    # -- the policy ----------------------------------------------------------------------------

    def schedule(self) -> tuple[list[Request], list[Request]]:
        """Apply the module's policy; returns (admitted, preempted) requests of this step.

        Admitted requests need fresh device state (the engine creates it); preempted ones have
        had theirs dropped and wait at the front of the queue.
        """
        for req in self.running:  # settle: never grows (the last call reserved at least this)
            length = req.fed_length if not req.in_prefill else req.prefilled
            if not self.allocator.settle(req, length, self.allocator.pages_needed(*self.next_call(req))):
                raise RuntimeError(f"{req.request_id}: settling its pages needed more pages")
        preempted = self._grow()
        admitted = [] if preempted else self._admit()
        return admitted, preempted

    def _grow(self) -> list[Request]:
        preempted = []
        i = 0
        while i < len(self.running):
            req = self.running[i]
            while not self.allocator.resize(req, *self.next_call(req)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                i += 1
        return preempted

    def _admit(self) -> list[Request]:
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            if not self.allocator.resize(req, *self.next_call(req)):
                break
            self.running.append(self.waiting.popleft())
            admitted.append(req)
        return admitted

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.release(req)
        req.preempt()
        self.waiting.appendleft(req)

    # -- membership ----------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """A running request is done: its pages and state go."""
        self.running.remove(req)
        self.allocator.release(req)
        req.state = req.dstate = None

    def find(self, request_id: str) -> Request | None:
        return next((r for r in (*self.waiting, *self.running) if r.request_id == request_id), None)

    def remove(self, request_id: str) -> bool:
        """Abort: drop a waiting or running request with its pages and state; whether it was known."""
        req = self.find(request_id)
        if req is None:
            return False
        (self.waiting if req in self.waiting else self.running).remove(req)
        self.allocator.release(req)
        req.state = req.dstate = None
        return True
