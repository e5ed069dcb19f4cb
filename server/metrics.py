"""Prometheus metrics of one server, on the server's own registry (never the process-global one).

Names follow SGLang and vLLM with a `dspark:` prefix. Speculative decoding is exported twice:
vLLM-style counters, from which any window's rates follow in PromQL (acceptance rate =
accepted / draft_tokens; τ = emitted / drafts; per-position survival = accepted_per_pos / drafts),
and SGLang-style gauges with the same ratios over the server's lifetime. Every counter sums the
`metrics.speculative_decoding` fields of the responses, so the two views agree exactly.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dspark.request import GenerationStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. TTFT spans a CPU prefill of a tiny model (ms) to a long prompt on a large one (s).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.4, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ("model_name",)

        def counter(name, doc, extra=()):
            return Counter(f"dspark:{name}", doc, labels + extra, registry=r)

        def gauge(name, doc):
            return Gauge(f"dspark:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"dspark:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self._model = model_name
        self.num_running = gauge("num_running_reqs", "Requests in the running batch.")
        self.num_waiting = gauge("num_queue_reqs", "Requests waiting for a batch slot.")
        self.requests = counter("num_requests", "Requests admitted to the engine.").labels(model_name)
        self.finished = counter("request_success", "Ended requests by finish reason: stop, length, abort (client "
                                "gone or shutdown), error (engine step failed).", ("finished_reason",))
        self.rejected = counter("request_rejected", "Valid requests the engine refused: queue_full, shutting_down, "
                                "invalid (its own last check).", ("reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(model_name)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time per output token after the first; a step that commits k tokens counts "
                             "k tokens of gap/k each (speculative steps are bursty).", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", _E2E_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Verify steps (speculative rounds).").labels(model_name)
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.").labels(model_name)
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(model_name)
        self.spec_emitted = counter("spec_decode_num_emitted_tokens",
                                    "Tokens committed by verify steps (bonus included).").labels(model_name)
        self.spec_accepted_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                         "Verify steps whose draft at `position` was accepted.", ("position",))
        self.accept_length = gauge("spec_accept_length", "τ: tokens committed per verify step (bonus included).")
        self.accept_rate = gauge("spec_accept_rate", "Accepted / verified draft tokens.")
        self._totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "emitted": 0}

    def reject(self, reason: str) -> None:
        self.rejected.labels(self._model, reason).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, gap_s: float, n: int) -> None:
        for _ in range(n):
            self.itl.observe(gap_s / n)

    def request_done(self, finish_reason: str, prompt_tokens: int, stats: GenerationStats | None,
                     e2e_s: float) -> None:
        self.finished.labels(self._model, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(e2e_s)
        if stats is None:
            return
        self.generation_tokens.inc(stats.new_tokens)
        accepted = stats.verified_tokens - stats.rejected_tokens
        emitted = max(stats.new_tokens - 1, 0) if stats.rounds else 0
        for key, value in (("drafts", stats.rounds), ("draft_tokens", stats.verified_tokens),
                           ("accepted", accepted), ("emitted", emitted)):
            self._totals[key] += value
        self.spec_drafts.inc(stats.rounds)
        self.spec_draft_tokens.inc(stats.verified_tokens)
        self.spec_accepted.inc(accepted)
        self.spec_emitted.inc(emitted)
        for position, count in enumerate(stats.position_accepts):
            self.spec_accepted_pos.labels(self._model, str(position)).inc(count)

    def render(self, num_running: int, num_waiting: int) -> bytes:
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        t = self._totals
        self.accept_length.set(t["emitted"] / t["drafts"] if t["drafts"] else 0.0)
        self.accept_rate.set(t["accepted"] / t["draft_tokens"] if t["draft_tokens"] else 0.0)
        return generate_latest(self.registry)
