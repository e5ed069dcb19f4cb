"""`create_app(engine)`: the HTTP routes of `dspark-serve`, and nothing else.

Request logic lives in `serving.py`, bodies in `protocol.py`/`responses.py`, the engine loop in
`async_engine.py`; everything one app needs is built here per call, so two apps in one process
share nothing.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

import dspark
from dspark.engine import Engine

from .async_engine import AsyncEngine
from .errors import APIError, error_response, install_error_handlers
from .metrics import CONTENT_TYPE, ServerMetrics
from .middleware import ApiKeyAuth, BodyLimit
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       ErrorResponse, ModelCard, ModelList)
from .responses import EngineStream, chat_events, chat_response, collect, completion_events, completion_response
from .serving import Run, Serving

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}
_STREAM = {"text/event-stream": {"schema": {"type": "string"}, "description": "with stream=true"}}


def create_app(engine: Engine, *, model_name: str, api_key: str | None = None, drain_s: float = 30.0,
               max_body_bytes: int = 8 << 20) -> FastAPI:
    """An OpenAI-compatible app serving `engine` (whose model must carry a tokenizer).

    model_name : the id clients pass as `model` and that /v1/models lists.
    api_key : when set, /v1/ routes need `Authorization: Bearer <api_key>`.
    drain_s : on shutdown, how long requests in flight may still finish before they are aborted.
    max_body_bytes : larger request bodies are refused with 413.
    """
    tokenizer = getattr(engine.model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("create_app: the model has no tokenizer; serving text needs one")
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(model_name)
    serving = Serving(async_engine, tokenizer, model_name, metrics)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown(drain_s)

    app = FastAPI(title="dspark-serve", version=dspark.__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions over dspark's speculative decoding engine.")
    app.state.async_engine = async_engine  # for embedding code and tests that inspect the engine
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)  # added last: runs first

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**_ERRORS, 200: {"content": _STREAM}})
    async def completions(body: CompletionRequest, request: Request):
        runs = await _runs(serving.prepare_completion(body))
        if body.stream:
            return EngineStream(completion_events(runs), runs)
        return completion_response(runs, await collect(runs, request))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_ERRORS, 200: {"content": _STREAM}})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        runs = await _runs(serving.prepare_chat(body))
        if body.stream:
            return EngineStream(chat_events(runs), runs)
        return chat_response(runs, await collect(runs, request))

    async def _runs(jobs) -> list[Run]:
        """One `Run` per choice, all submitted (or none: `submit_all`)."""
        return [Run(serving, job, handle) for job, handle in zip(jobs, await serving.submit_all(jobs))]

    def card() -> ModelCard:
        return ModelCard(id=model_name, created=started, max_model_len=serving.context)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models():
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model_id: str):
        serving.check_model(model_id)
        return card()

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        if not async_engine.accepting:
            return error_response(APIError(503, "shutting down or engine loop stopped", code="unavailable"))
        return JSONResponse({"status": "ok", "running": async_engine.num_running,
                             "waiting": async_engine.num_waiting})

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics():
        return Response(metrics.render(async_engine.num_running, async_engine.num_waiting), media_type=CONTENT_TYPE)

    return app
