"""The asyncio bridge: HTTP handlers on the event loop, one `Engine` stepped by one loop task.

`Engine` is synchronous and single-threaded. Here exactly one task (`_run`) touches it: it applies
the queued `add`/`abort` commands between steps, runs `engine.step()` on a one-thread executor (so
the event loop keeps serving HTTP while the model computes), and hands each request's new tokens to
that request's asyncio queue. Handlers never call the model themselves: a hundred open streams cost
one batched step per round, not a hundred model calls.

Because commands are applied only between steps, `submit` answers after at most one step; an
`EngineFull` or `ValueError` from `engine.add_request` reaches the caller through its future, so a
full queue is a 429 before any streaming starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dspark.engine import Engine
from dspark.request import GenerationStats
from dspark.sampling import SamplingParams

log = logging.getLogger("dspark_server")


class ShuttingDown(RuntimeError):
    """The server no longer accepts requests (the server answers 503)."""


class EngineFailed(RuntimeError):
    """A step raised; every request that was in flight is lost (the server answers 500)."""


@dataclass(frozen=True)
class Update:
    """Tokens committed for one request by one step. `stats` is a copy taken between steps, so the
    handler may read it while the engine thread runs the next one."""

    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stats: GenerationStats | None


class RequestHandle:
    """One submitted request as its handler sees it: an async iterator of `Update`s that ends with
    the finishing one ("stop", "length" or "abort"); raises `EngineFailed` if the engine broke."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue[Update | BaseException] = asyncio.Queue()
        self._last_stats: GenerationStats | None = None

    def _put(self, item: Update | BaseException) -> None:
        if isinstance(item, Update) and item.stats is not None:
            self._last_stats = item.stats
        self._queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Update:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Add:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    request_id: str
    future: asyncio.Future


class AsyncEngine:
    """Owns an `Engine` and the one task that steps it. Create inside a running event loop's
    lifetime: `await start()`, then `submit`/`abort`, then `await shutdown(drain_s)`."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.num_running = 0  # snapshots taken between steps, for /metrics
        self.num_waiting = 0
        self._handles: dict[str, RequestHandle] = {}
        self._commands: deque[_Add | str] = deque()  # _Add, or the id of a request to abort
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while no request is in flight (shutdown drains on it)
        self._idle.set()
        self._accepting = False
        self._stopping = False
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def accepting(self) -> bool:
        return self._accepting and self._task is not None and not self._task.done()

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    async def start(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-engine")
        self._task = asyncio.create_task(self._run(), name="dspark-engine-loop")
        self._accepting = True

    async def submit(self, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                     stop_token_ids=(), *, request_id: str) -> RequestHandle:
        """Queue a request; raises ShuttingDown, EngineFull or ValueError (from `add_request`)."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        future = asyncio.get_running_loop().create_future()
        self._commands.append(_Add(list(prompt_ids), params, max_new_tokens, tuple(stop_token_ids),
                                   request_id, future))
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            # The caller went away after the loop admitted the request: nobody will read it.
            if future.done() and not future.cancelled() and future.exception() is None:
                self.abort(future.result().request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Drop a request (client gone, stop string seen, shutdown). Idempotent; its handle gets a
        final "abort" update if it is still open. Safe to call from `finally` blocks: no await."""
        self._commands.append(request_id)
        self._wake.set()

    async def shutdown(self, drain_s: float) -> None:
        """Stop accepting (new submits: ShuttingDown), let in-flight requests finish for up to
        `drain_s` seconds, abort the rest, then stop the loop task and its thread."""
        self._accepting = False
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(drain_s, 0.0))
        except asyncio.TimeoutError:
            log.warning("shutdown: aborting %d requests still in flight after %.1f s", len(self._handles), drain_s)
        for request_id in list(self._handles):
            self.abort(request_id)
        self._stopping = True
        self._wake.set()
        await self._task
        self._executor.shutdown(wait=True)

    # -- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_commands()
            if self.engine.has_work():
                try:
                    events = await loop.run_in_executor(self._executor, self.engine.step)
                except Exception as e:  # a bug in a step must not hang every client
                    log.exception("engine step failed; aborting %d requests", len(self._handles))
                    self._fail_all(EngineFailed(f"engine step failed: {type(e).__name__}: {e}"))
                    continue
                self._dispatch(events)
                continue
            if self._stopping and not self._commands:
                return
            self._wake.clear()
            if not self._commands:
                await self._wake.wait()

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, str):
                self._abort_now(command)
            elif not command.future.cancelled():
                self._add_now(command)
        self._snapshot_load()

    def _add_now(self, add: _Add) -> None:
        if not self._accepting:
            add.future.set_exception(ShuttingDown("the server is shutting down"))
            return
        try:
            self.engine.add_request(add.prompt_ids, add.params, add.max_new_tokens,
                                    stop_token_ids=add.stop_token_ids, request_id=add.request_id)
        except Exception as e:  # EngineFull or ValueError: the caller maps it to a status
            add.future.set_exception(e)
            return
        handle = RequestHandle(add.request_id)
        self._handles[add.request_id] = handle
        self._idle.clear()
        add.future.set_result(handle)

    def _abort_now(self, request_id: str) -> None:
        self.engine.abort(request_id)
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            handle._put(Update([], True, "abort", handle._last_stats))
        self._mark_idle()

    def _dispatch(self, events) -> None:
        for event in events:
            handle = self._handles.get(event.request_id)
            if handle is None:  # aborted while its last step ran
                continue
            handle._put(Update(list(event.new_token_ids), event.finished, event.finish_reason,
                               _copy_stats(event.stats)))
            if event.finished:
                del self._handles[event.request_id]
        self._mark_idle()
        self._snapshot_load()

    def _fail_all(self, error: EngineFailed) -> None:
        for request_id, handle in list(self._handles.items()):
            handle._put(error)
        self._handles.clear()
        # Requests may be half-updated after a failed step; dropping them leaves the engine clean.
        for req in list(self.engine.waiting) + list(self.engine.running):
            self.engine.abort(req.request_id)
        self._mark_idle()
        self._snapshot_load()

    def _mark_idle(self) -> None:
        if not self._handles:
            self._idle.set()

    def _snapshot_load(self) -> None:
        self.num_running, self.num_waiting = len(self.engine.running), len(self.engine.waiting)


def _copy_stats(stats: GenerationStats) -> GenerationStats:
    return dataclasses.replace(stats, accept_hist=list(stats.accept_hist),
                               position_accepts=list(stats.position_accepts))
