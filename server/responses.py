"""OpenAI response bodies, whole or as server-sent events, from a `Run`.

Streams are `data: <json>\\n\\n` events ending in `data: [DONE]`. The chunk carrying `finish_reason`
also carries `metrics` (speculative decoding figures) so that a streaming client gets them without
asking for usage; `stream_options.include_usage` adds OpenAI's final usage chunk (empty `choices`).
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
from .serving import Piece, Run

DONE = "data: [DONE]\n\n"


def _sse(body) -> str:
    return f"data: {body.model_dump_json() if hasattr(body, 'model_dump_json') else json.dumps(body)}\n\n"


class EngineStream(StreamingResponse):
    """An SSE response that frees its engine request however the response ends, even when the
    client leaves before the body iterator ever starts (then no generator `finally` would run)."""

    def __init__(self, events: AsyncIterator[str], run: Run):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._run = run

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.close()


# -- whole responses -------------------------------------------------------------------------------


async def collect(run: Run, request) -> str:
    """All text of a non-streaming request; aborts it if the client disconnects meanwhile."""
    watcher = asyncio.create_task(run.serving.abort_on_disconnect(request, run.handle))
    texts = []
    try:
        async with aclosing(run.pieces()) as pieces:
            async for piece in pieces:
                texts.append(piece.text)
    except EngineFailed as e:
        raise APIError(500, str(e), code="engine_failed") from None
    finally:
        watcher.cancel()
    return "".join(texts)


def completion_response(run: Run, text: str) -> CompletionResponse:
    ids = run.job.return_token_ids
    choice = CompletionChoice(text=text, finish_reason=run.finish_reason, token_ids=run.token_ids if ids else None,
                              prompt_token_ids=run.job.prompt_ids if ids else None)
    return CompletionResponse(id=run.job.request_id, created=run.job.created, model=run.serving.model_name,
                              choices=[choice], usage=Usage(**run.usage()), metrics=run.request_metrics())


def chat_response(run: Run, text: str) -> ChatCompletionResponse:
    ids = run.job.return_token_ids
    choice = ChatChoice(message=ChatMessageOut(content=text), finish_reason=run.finish_reason,
                        token_ids=run.token_ids if ids else None, prompt_token_ids=run.job.prompt_ids if ids else None)
    return ChatCompletionResponse(id=run.job.request_id, created=run.job.created, model=run.serving.model_name,
                                  choices=[choice], usage=Usage(**run.usage()), metrics=run.request_metrics())


# -- streams ---------------------------------------------------------------------------------------


async def _events(run: Run, chunks: Callable[[Piece, bool], list], usage_chunk: Callable[[], object],
                  opening=None):
    first = True
    try:
        if opening is not None:
            yield _sse(opening)
        async with aclosing(run.pieces()) as pieces:
            async for piece in pieces:
                for chunk in chunks(piece, first):
                    yield _sse(chunk)
                first = False
        if run.job.include_usage:
            yield _sse(usage_chunk())
    except EngineFailed as e:
        yield _sse({"error": {"message": str(e), "type": "internal_error", "param": None, "code": "engine_failed"}})
    yield DONE


def completion_events(run: Run) -> AsyncIterator[str]:
    job, name = run.job, run.serving.model_name

    def chunk(choices, **extra):
        return CompletionResponse(id=job.request_id, created=job.created, model=name, choices=choices, **extra)

    def chunks(piece: Piece, first: bool) -> list:
        choice = CompletionChoice(text=piece.text, finish_reason=piece.finish_reason,
                                  token_ids=piece.token_ids if job.return_token_ids else None,
                                  prompt_token_ids=job.prompt_ids if job.return_token_ids and first else None)
        return [chunk([choice], metrics=run.request_metrics() if piece.finish_reason else None)]

    return _events(run, chunks, lambda: chunk([], usage=Usage(**run.usage())))


def chat_events(run: Run) -> AsyncIterator[str]:
    job, name = run.job, run.serving.model_name

    def chunk(choices, **extra):
        return ChatCompletionResponse(id=job.request_id, object="chat.completion.chunk", created=job.created,
                                      model=name, choices=choices, **extra)

    def chunks(piece: Piece, first: bool) -> list:
        out = []
        if piece.text or (job.return_token_ids and piece.token_ids):
            out.append(chunk([ChatChoice(delta=ChatMessageOut(role=None, content=piece.text), finish_reason=None,
                                         token_ids=piece.token_ids if job.return_token_ids else None)]))
        if piece.finish_reason:
            out.append(chunk([ChatChoice(delta=ChatMessageOut(role=None), finish_reason=piece.finish_reason)],
                             metrics=run.request_metrics()))
        return out

    # OpenAI opens every chat stream with the role, before any token exists.
    opening = chunk([ChatChoice(delta=ChatMessageOut(content=""), finish_reason=None,
                                prompt_token_ids=job.prompt_ids if job.return_token_ids else None)])
    return _events(run, chunks, lambda: chunk([], usage=Usage(**run.usage())), opening)
