"""From a validated request to engine tokens and back: limits, submission, text, finish, metrics.

`Serving.prepare_*` turns a request into its `Job`s (prompt ids, sampling parameters, limits checked
with OpenAI-style 400s; one job per choice: `n` of them, choice i seeded with seed + i when a seed is
given); `Serving.submit_all` queues them (429 when the engine queue is full, 503 while shutting down;
all or none); a `Run` per job then turns its engine updates into text pieces, cutting at stop
strings, and records the engine request's metrics exactly once however it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dspark.engine import EngineFull
from dspark.request import GenerationStats
from dspark.sampling import SamplingParams
from dspark.tokenizer import prompt_codec

from .async_engine import AsyncEngine, EngineFailed, RequestHandle, ShuttingDown
from .errors import APIError
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, RequestMetrics, SpeculativeMetrics
from .text import IncrementalDecoder, StopMatcher, render_chat

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks whether its client left


@dataclass
class Job:
    """One request ready for the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stops: list[str]
    stop_token_ids: list[int]
    return_token_ids: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.perf_counter)
    response_id: str = ""  # the id clients see (the request's; a choice's engine request id adds "-i")
    index: int = 0  # the choice this job answers
    echo: str = ""  # text before the choice's own (completions' `echo`: the prompt)

    def __post_init__(self):
        self.response_id = self.response_id or self.request_id


def choices(job: Job, n: int) -> list[Job]:
    """The n jobs of a request asking for n choices: engine request ids `{id}-{i}`, choice i seeded
    with (seed + i) mod 2^64 when the request has a seed (distinct, reproducible samples), unseeded
    otherwise; n = 1 is the job itself."""
    if n == 1:
        return [job]
    seed = job.params.seed
    return [dataclasses.replace(job, request_id=f"{job.request_id}-{i}", response_id=job.request_id, index=i,
                                params=dataclasses.replace(job.params, seed=None if seed is None else (seed + i) % 2**64))
            for i in range(n)]


@dataclass(frozen=True)
class Piece:
    """New text (and the token ids behind it) for the client; `finish_reason` on the last one."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


class Serving:
    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, metrics: ServerMetrics):
        self.engine, self.tokenizer, self.model_name, self.metrics = engine, tokenizer, model_name, metrics
        self.codec = prompt_codec(engine.engine.model)
        config, model_config = engine.engine.config, engine.engine.model.config
        self.max_prompt_tokens, self.max_new_tokens = config.max_prompt_tokens, config.max_new_tokens
        self.context, self.vocab = model_config.max_position_embeddings, model_config.vocab_size

    # -- requests -> jobs ------------------------------------------------------------------------

    def prepare_completion(self, body: CompletionRequest) -> list[Job]:
        self.check_model(body.model)
        ids = self.codec.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} outside the vocabulary [0, {self.vocab})", param="prompt")
        job = self._job("cmpl", body, ids, body.max_tokens, "prompt")
        if body.echo:  # the prompt as sent, or the text of its token ids
            job.echo = body.prompt if isinstance(body.prompt, str) else self.codec.decode(ids)
        return choices(job, body.n)

    def prepare_chat(self, body: ChatCompletionRequest) -> list[Job]:
        self.check_model(body.model)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = render_chat(self.tokenizer, messages)
        except ValueError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        return choices(self._job("chatcmpl", body, self.codec.encode(text), body.max_new_tokens(), "messages"), body.n)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model {name!r} is not served here; GET /v1/models lists {self.model_name!r}",
                           param="model", code="model_not_found")

    def _job(self, prefix: str, body, ids: list[int], max_tokens: int | None, prompt_param: str) -> Job:
        if not ids:
            raise APIError(400, f"{prompt_param}: the prompt encodes to zero tokens", param=prompt_param)
        room = self.context - len(ids)
        if len(ids) > self.max_prompt_tokens or room < 1:
            raise APIError(400, f"{prompt_param}: {len(ids)} prompt tokens exceed this server's limit of "
                           f"{min(self.max_prompt_tokens, self.context - 1)}", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is None:  # no limit given (chat's default): as much as the server and context allow
            max_tokens = min(self.max_new_tokens, room)
        elif max_tokens > self.max_new_tokens:
            raise APIError(400, f"max_tokens: {max_tokens} exceeds this server's limit of {self.max_new_tokens}",
                           param="max_tokens")
        elif max_tokens > room:
            raise APIError(400, f"max_tokens: {len(ids)} prompt tokens + {max_tokens} new tokens exceed the "
                           f"model's context of {self.context}", param="max_tokens", code="context_length_exceeded")
        bad = next((t for t in body.stop_token_ids or () if t >= self.vocab), None)
        if bad is not None:
            raise APIError(400, f"stop_token_ids: {bad} outside the vocabulary [0, {self.vocab})",
                           param="stop_token_ids")
        params = SamplingParams(body.temperature, body.top_p, max(body.top_k, 0), body.seed)
        return Job(f"{prefix}-{uuid.uuid4().hex}", ids, params, max_tokens, body.stop,
                   list(body.stop_token_ids or ()), body.return_token_ids, body.include_usage_chunk())

    # -- jobs -> engine --------------------------------------------------------------------------

    async def submit(self, job: Job) -> RequestHandle:
        try:
            handle = await self.engine.submit(job.prompt_ids, job.params, job.max_new_tokens,
                                              job.stop_token_ids, request_id=job.request_id)
        except ShuttingDown as e:
            self.metrics.reject("shutting_down")
            raise APIError(503, str(e), code="shutting_down") from None
        except EngineFull as e:
            self.metrics.reject("queue_full")
            raise APIError(429, f"server overloaded, retry later: {e}", code="queue_full") from None
        except ValueError as e:  # limits are checked above; this is the engine's last word
            self.metrics.reject("invalid")
            raise APIError(400, str(e)) from None
        self.metrics.requests.inc()
        return handle

    async def submit_all(self, jobs: list[Job]) -> list[RequestHandle]:
        """`submit` every job of a request, or none: when one is refused, those queued are aborted."""
        handles = []
        try:
            for job in jobs:
                handles.append(await self.submit(job))
        except APIError:
            for handle in handles:
                self.engine.abort(handle.request_id)
            raise
        return handles

    async def abort_on_disconnect(self, request, handle: RequestHandle) -> None:
        """For non-streaming requests, which no send would reveal as abandoned: poll the socket."""
        while not handle.finished:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                self.engine.abort(handle.request_id)
                return


class Run:
    """One request's life after submission: engine updates in, `Piece`s out (`pieces()`)."""

    def __init__(self, serving: Serving, job: Job, handle: RequestHandle):
        self.serving, self.job, self.handle = serving, job, handle
        self.token_ids: list[int] = []
        self.stats: GenerationStats | None = None
        self.finish_reason: str | None = None
        self.first_token_s: float | None = None
        self.e2e_s = 0.0
        self._closed = False
        self._decoder = IncrementalDecoder(serving.codec.decode)
        self._stop = StopMatcher(job.stops)

    async def pieces(self) -> AsyncIterator[Piece]:
        metrics, last = self.serving.metrics, None
        try:
            async for update in self.handle:
                now = time.perf_counter()
                if update.token_ids:
                    if last is None:
                        self.first_token_s = now - self.job.arrival
                        metrics.first_token(self.first_token_s)
                    else:
                        metrics.tokens(now - last, len(update.token_ids))
                    last = now
                self.token_ids += update.token_ids
                self.stats = update.stats or self.stats
                text = self._stop.feed(self._decoder.push(update.token_ids))
                if update.finished:
                    text += self._stop.feed(self._decoder.flush()) + self._stop.flush()
                if self._stop.stopped or update.finished:
                    self.finish_reason = "stop" if self._stop.stopped else update.finish_reason
                    self.e2e_s = now - self.job.arrival
                    yield Piece(text, update.token_ids, self.finish_reason)
                    return
                if text or (self.job.return_token_ids and update.token_ids):
                    yield Piece(text, update.token_ids)
        except EngineFailed:
            self.finish_reason = "error"
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Free the engine request if it is still running and record metrics; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.handle.finished:  # stop string, client gone, or an error: free the engine slot
            self.serving.engine.abort(self.handle.request_id)
        self.e2e_s = self.e2e_s or time.perf_counter() - self.job.arrival
        self.serving.metrics.request_done(self.finish_reason or "abort", len(self.job.prompt_ids),
                                          self.stats, self.e2e_s)

    def request_metrics(self) -> RequestMetrics:
        s = self.stats or GenerationStats()
        accepted = s.verified_tokens - s.rejected_tokens
        spec = SpeculativeMetrics(
            num_spec_steps=s.rounds, num_draft_tokens=s.verified_tokens, num_accepted_draft_tokens=accepted,
            mean_acceptance_length=s.tau, draft_acceptance_rate=accepted / s.verified_tokens if s.verified_tokens else 0.0,
            acceptance_histogram=list(s.accept_hist), per_position_accepted=list(s.position_accepts))
        return RequestMetrics(speculative_decoding=spec, time_to_first_token_s=self.first_token_s,
                              e2e_latency_s=self.e2e_s)


def usage(runs: list[Run]) -> dict:
    """OpenAI usage of a request's runs (its choices): the prompt once, every choice's tokens
    (completion_tokens counts every token generated, also any that arrived in the same step after a
    stop string cut the text)."""
    p = len(runs[0].job.prompt_ids)
    n = sum(len(run.token_ids) for run in runs)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def request_metrics(runs: list[Run]) -> RequestMetrics:
    """The `metrics` of a request: its run's, or over its choices' runs: counts summed, τ over all their
    verify steps, the first token's time of the first choice to get one, the latest end."""
    if len(runs) == 1:
        return runs[0].request_metrics()
    parts = [run.request_metrics() for run in runs]
    spec = [m.speculative_decoding for m in parts]
    steps = sum(s.num_spec_steps for s in spec)
    drafted = sum(s.num_draft_tokens for s in spec)
    accepted = sum(s.num_accepted_draft_tokens for s in spec)
    merged = SpeculativeMetrics(
        num_spec_steps=steps, num_draft_tokens=drafted, num_accepted_draft_tokens=accepted,
        mean_acceptance_length=sum(s.mean_acceptance_length * s.num_spec_steps for s in spec) / steps if steps else 0.0,
        draft_acceptance_rate=accepted / drafted if drafted else 0.0,
        acceptance_histogram=_sum_lists([s.acceptance_histogram for s in spec]),
        per_position_accepted=_sum_lists([s.per_position_accepted for s in spec]))
    firsts = [m.time_to_first_token_s for m in parts if m.time_to_first_token_s is not None]
    return RequestMetrics(speculative_decoding=merged, time_to_first_token_s=min(firsts) if firsts else None,
                          e2e_latency_s=max(m.e2e_latency_s for m in parts))


def _sum_lists(lists: list[list[int]]) -> list[int]:
    width = max(map(len, lists), default=0)
    return [sum(x[i] for x in lists if i < len(x)) for i in range(width)]
