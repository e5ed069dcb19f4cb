"""OpenAI response bodies, whole or as server-sent events, from a `Run`.

Streams are `data: <json>\\n\\n` events ending in `data: [DONE]`. The chunk carrying `finish_reason`
also carries `metrics` (speculative decoding figures) so that a streaming client gets them without
asking for usage; `stream_options.include_usage` adds OpenAI's final usage chunk (empty `choices`).
A request for n choices runs n engine requests (`Run`s): whole responses list their choices by
index, streams interleave the choices' chunks as they come (each chunk one choice, with its index).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from starlette.responses import StreamingResponse

from .async_engine import EngineFailed
from .errors import APIError
from .protocol import (ChatChoice, ChatCompletionResponse, ChatMessageOut, CompletionChoice, CompletionResponse,
                       Usage)
from .serving import Piece, Run, request_metrics, usage

DONE = "data: [DONE]\n\n"


def _sse(body) -> str:
    return f"data: {body.model_dump_json() if hasattr(body, 'model_dump_json') else json.dumps(body)}\n\n"


class EngineStream(StreamingResponse):
    """An SSE response that frees its engine requests however the response ends, even when the
    client leaves before the body iterator ever starts (then no generator `finally` would run)."""

    def __init__(self, events: AsyncIterator[str], runs: list[Run]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._runs = runs

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for run in self._runs:
                run.close()


# -- whole responses -------------------------------------------------------------------------------


async def collect(runs: list[Run], request) -> list[str]:
    """All text of each choice of a non-streaming request, generated together; aborts them all if
    the client disconnects or one fails meanwhile."""
    watchers = [asyncio.create_task(run.serving.abort_on_disconnect(request, run.handle)) for run in runs]
    try:
        return await asyncio.gather(*(_text(run) for run in runs))
    except EngineFailed as e:
        raise APIError(500, str(e), code="engine_failed") from None
    finally:
        for watcher in watchers:
            watcher.cancel()
        for run in runs:  # a choice still running when another failed
            run.close()


async def _text(run: Run) -> str:
    texts = []
    async with aclosing(run.pieces()) as pieces:
        async for piece in pieces:
            texts.append(piece.text)
    return "".join(texts)


def completion_response(runs: list[Run], texts: list[str]) -> CompletionResponse:
    job = runs[0].job
    choices = [CompletionChoice(index=run.job.index, text=job.echo + text, finish_reason=run.finish_reason,
                                token_ids=run.token_ids if job.return_token_ids else None,
                                prompt_token_ids=job.prompt_ids if job.return_token_ids else None)
               for run, text in zip(runs, texts)]
    return CompletionResponse(id=job.response_id, created=job.created, model=runs[0].serving.model_name,
                              choices=choices, usage=Usage(**usage(runs)), metrics=request_metrics(runs))


def chat_response(runs: list[Run], texts: list[str]) -> ChatCompletionResponse:
    job = runs[0].job
    choices = [ChatChoice(index=run.job.index, message=ChatMessageOut(content=text), finish_reason=run.finish_reason,
                          token_ids=run.token_ids if job.return_token_ids else None,
                          prompt_token_ids=job.prompt_ids if job.return_token_ids else None)
               for run, text in zip(runs, texts)]
    return ChatCompletionResponse(id=job.response_id, created=job.created, model=runs[0].serving.model_name,
                                  choices=choices, usage=Usage(**usage(runs)), metrics=request_metrics(runs))


# -- streams ---------------------------------------------------------------------------------------


async def _events(runs: list[Run], chunks: Callable[[Run, Piece, bool], list], usage_chunk: Callable[[], object],
                  openings=()):
    """The SSE events of a request's runs: `openings`, then each run's chunks as its pieces arrive (the
    runs are pumped concurrently into one queue), the usage chunk when asked for, [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: Run) -> None:
        try:
            async with aclosing(run.pieces()) as pieces:
                async for piece in pieces:
                    await queue.put((run, piece, None))
        except EngineFailed as e:
            await queue.put((run, None, e))
            return
        await queue.put((run, None, None))  # this run is done

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        for opening in openings:
            yield _sse(opening)
        first, running = {id(run): True for run in runs}, len(runs)
        while running:
            run, piece, error = await queue.get()
            if error is not None:
                yield _sse({"error": {"message": str(error), "type": "internal_error", "param": None,
                                      "code": "engine_failed"}})
                break
            if piece is None:
                running -= 1
                continue
            for chunk in chunks(run, piece, first[id(run)]):
                yield _sse(chunk)
            first[id(run)] = False
        else:
            if runs[0].job.include_usage:
                yield _sse(usage_chunk())
    finally:
        for task in tasks:  # a client gone, or an error: the pumps close their runs' pieces
            task.cancel()
    yield DONE


def completion_events(runs: list[Run]) -> AsyncIterator[str]:
    job, name = runs[0].job, runs[0].serving.model_name

    def chunk(choices, **extra):
        return CompletionResponse(id=job.response_id, created=job.created, model=name, choices=choices, **extra)

    def chunks(run: Run, piece: Piece, first: bool) -> list:
        choice = CompletionChoice(index=run.job.index, text=(job.echo if first else "") + piece.text,
                                  finish_reason=piece.finish_reason,
                                  token_ids=piece.token_ids if job.return_token_ids else None,
                                  prompt_token_ids=job.prompt_ids if job.return_token_ids and first else None)
        return [chunk([choice], metrics=run.request_metrics() if piece.finish_reason else None)]

    return _events(runs, chunks, lambda: chunk([], usage=Usage(**usage(runs))))


def chat_events(runs: list[Run]) -> AsyncIterator[str]:
    job, name = runs[0].job, runs[0].serving.model_name

    def chunk(choices, **extra):
        return ChatCompletionResponse(id=job.response_id, object="chat.completion.chunk", created=job.created,
                                      model=name, choices=choices, **extra)

    def chunks(run: Run, piece: Piece, first: bool) -> list:
        out, index = [], run.job.index
        if piece.text or (job.return_token_ids and piece.token_ids):
            out.append(chunk([ChatChoice(index=index, delta=ChatMessageOut(role=None, content=piece.text),
                                         finish_reason=None, token_ids=piece.token_ids if job.return_token_ids else None)]))
        if piece.finish_reason:
            out.append(chunk([ChatChoice(index=index, delta=ChatMessageOut(role=None), finish_reason=piece.finish_reason)],
                             metrics=run.request_metrics()))
        return out

    # OpenAI opens every chat stream with the role, before any token exists: once per choice.
    openings = [chunk([ChatChoice(index=run.job.index, delta=ChatMessageOut(content=""), finish_reason=None,
                                  prompt_token_ids=job.prompt_ids if job.return_token_ids else None)]) for run in runs]
    return _events(runs, chunks, lambda: chunk([], usage=Usage(**usage(runs))), openings)
