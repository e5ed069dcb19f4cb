"""/metrics is valid Prometheus text, and its counters add up to what the responses reported."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = ["aaaaaaaaaaaaaaaa", "abababababababab", "The quick brown fox", "hello hello hello"]


def _scrape(client) -> dict[tuple, float]:
    """{(sample name, sorted label items without model_name): value}; parsing fails on bad text."""
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def _get(metrics, name, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def _stream_metrics(client, body) -> tuple[dict, dict]:
    """(usage, metrics) of a streamed completion with include_usage."""
    usage = metrics = None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                metrics = chunk.get("metrics", metrics)
                usage = chunk.get("usage", usage)
    return usage, metrics


def test_metric_names_follow_the_conventions(client):
    names = {name for name, _ in _scrape(client)}
    for expected in ("dspark:num_running_reqs", "dspark:num_queue_reqs", "dspark:num_requests_total",
                     "dspark:prompt_tokens_total", "dspark:generation_tokens_total",
                     "dspark:time_to_first_token_seconds_bucket", "dspark:inter_token_latency_seconds_bucket",
                     "dspark:e2e_request_latency_seconds_bucket", "dspark:spec_accept_length", "dspark:spec_accept_rate",
                     "dspark:spec_decode_num_drafts_total", "dspark:spec_decode_num_draft_tokens_total",
                     "dspark:spec_decode_num_accepted_tokens_total"):
        assert expected in names, expected


def test_counters_agree_with_the_responses(server, client):
    assert server.wait_idle()
    before = _scrape(client)
    results = []  # (usage, metrics) per request, half streamed
    for i, prompt in enumerate(PROMPTS * 2):
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0 if i % 3 else 0.7, "seed": i}
        if i % 2:
            results.append(_stream_metrics(client, body))
        else:
            out = client.post("/v1/completions", json=body).json()
            results.append((out["usage"], out["metrics"]))
    after = _scrape(client)

    def delta(name, **labels):
        return _get(after, name, **labels) - _get(before, name, **labels)

    specs = [m["speculative_decoding"] for _, m in results]
    assert delta("dspark:num_requests_total") == len(results)
    assert delta("dspark:prompt_tokens_total") == sum(u["prompt_tokens"] for u, _ in results)
    assert delta("dspark:generation_tokens_total") == sum(u["completion_tokens"] for u, _ in results)
    assert delta("dspark:spec_decode_num_drafts_total") == sum(s["num_spec_steps"] for s in specs)
    assert delta("dspark:spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in specs)
    accepted = sum(s["num_accepted_draft_tokens"] for s in specs)
    assert delta("dspark:spec_decode_num_accepted_tokens_total") == accepted > 0
    for k in range(len(specs[0]["per_position_accepted"])):
        assert delta("dspark:spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) == sum(
            s["per_position_accepted"][k] for s in specs)
    # τ: committed tokens per verify step, bonus included; each response's own τ weighs by its steps.
    emitted = sum(s["mean_acceptance_length"] * s["num_spec_steps"] for s in specs)
    assert delta("dspark:spec_decode_num_emitted_tokens_total") == pytest.approx(emitted)
    assert sum(delta("dspark:request_success_total", finished_reason=r) for r in ("stop", "length")) == len(results)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"dspark:{histogram}_count") == len(results)
    assert delta("dspark:inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u, _ in results)
    # The lifetime gauges are exactly the ratios of the lifetime counters.
    assert _get(after, "dspark:spec_accept_length") == pytest.approx(
        _get(after, "dspark:spec_decode_num_emitted_tokens_total") / _get(after, "dspark:spec_decode_num_drafts_total"))
    assert _get(after, "dspark:spec_accept_rate") == pytest.approx(
        _get(after, "dspark:spec_decode_num_accepted_tokens_total")
        / _get(after, "dspark:spec_decode_num_draft_tokens_total"))
    assert _get(after, "dspark:num_running_reqs") == 0 and _get(after, "dspark:num_queue_reqs") == 0


def test_refusals_are_counted(make_server):
    small = make_server(eos=False, max_running=1, max_waiting=1, max_new_tokens=200)
    body = {"prompt": "The quick brown fox", "max_tokens": 200, "temperature": 0, "stream": True}
    with small.client() as c, c.stream("POST", "/v1/completions", json=body), \
            c.stream("POST", "/v1/completions", json=body):
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 429
        assert _get(_scrape(c), "dspark:request_rejected_total", reason="queue_full") == 1
